/* SPDX-License-Identifier: MIT */
/*
 * keylock-bench, the locks under test: the baselines (striped mutexes, a strict
 * FIFO lock) and keylock behind one interface, and the generated keys.
 */
#include "bench.h"

static void
fifo_init(struct fifo *f)
{
	pthread_mutex_init(&f->lock, NULL);
	f->held = false;
	f->head = f->tail = NULL;
}

void
fifo_acquire(struct fifo *f)
{
	struct fifo_waiter w;

	pthread_mutex_lock(&f->lock);
	if (!f->held) {
		f->held = true;
		pthread_mutex_unlock(&f->lock);
		return;
	}
	pthread_cond_init(&w.cond, NULL);
	w.granted = false;
	w.next = NULL;
	if (f->tail != NULL)
		f->tail->next = &w;
	else
		f->head = &w;
	f->tail = &w;
	while (!w.granted)
		pthread_cond_wait(&w.cond, &f->lock);
	pthread_mutex_unlock(&f->lock);
	pthread_cond_destroy(&w.cond);
}

void
fifo_release(struct fifo *f)
{
	struct fifo_waiter *w;

	pthread_mutex_lock(&f->lock);
	if ((w = f->head) != NULL) {
		f->head = w->next;
		if (f->head == NULL)
			f->tail = NULL;
		/* Signalled under the lock: the waiter cannot return and
		 * pop its stack frame before we unlock. */
		w->granted = true;
		pthread_cond_signal(&w->cond);
	} else {
		f->held = false;
	}
	pthread_mutex_unlock(&f->lock);
}

/* The striped table: a cache line per stripe so that two hot stripes do
 * not share one. */
struct stripe {
	pthread_mutex_t m;
} __attribute__((aligned(64)));

static struct stripe stripes[NSTRIPES];

void
stripes_init(void)
{
	for (int i = 0; i < NSTRIPES; i++)
		pthread_mutex_init(&stripes[i].m, NULL);
}

pthread_mutex_t *
stripe_of(const char *key)
{
	uint64_t h = 1469598103934665603u;

	for (const unsigned char *p = (const unsigned char *)key; *p; p++)
		h = (h ^ *p) * 1099511628211u;
	return &stripes[(h ^ (h >> 32)) & (NSTRIPES - 1)].m;
}

const char *const kind_name[NKINDS] = {
	"pthread", "striped", "fifo", "kl_mutex", "kl_lock", "kl_eventual",
	"none"
};
const char *const kind_label[NKINDS] = {
	"pthread_mutex", "striped x256", "fifo baseline", "kl_mutex",
	"kl_lock/memory", "kl_mutex eventual", "no lock"
};
const char *const kind_color[NKINDS] = {
	"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#d62728", "#8c564b",
	"#7f7f7f"
};

struct subject subjects[NKINDS];

kl_lock *
new_keyed_lock(kl_provider **prov)
{
	kl_lock_opts o = KL_LOCK_OPTS_INIT;
	kl_lock *l;
	int rc;

	/* A private provider per lock: no run sees another's keys. */
	if ((rc = kl_memory_provider_new(prov)) != KL_OK)
		die("kl_memory_provider_new: %s", kl_strerror(rc));
	o.provider = *prov;
	if ((rc = kl_lock_new(&l, &o)) != KL_OK)
		die("kl_lock_new: %s", kl_strerror(rc));
	return l;
}

void
subjects_init(void)
{
	int rc;

	for (int k = 0; k < NKINDS; k++)
		subjects[k].kind = (enum kind)k;
	pthread_mutex_init(&subjects[K_PTHREAD].pm, NULL);
	fifo_init(&subjects[K_FIFO].fifo);
	if ((rc = kl_mutex_new(&subjects[K_KL_MUTEX].km, NULL)) != KL_OK)
		die("kl_mutex_new: %s", kl_strerror(rc));
	{
		kl_queue_opts o = KL_QUEUE_OPTS_INIT;

		o.flags = KL_EVENTUAL;
		if ((rc = kl_mutex_new(&subjects[K_KL_EVENTUAL].km, &o)) !=
		    KL_OK)
			die("kl_mutex_new: %s", kl_strerror(rc));
	}
	subjects[K_KL_LOCK].kl = new_keyed_lock(&subjects[K_KL_LOCK].prov);
}

void
subjects_free(void)
{
	kl_mutex_free(subjects[K_KL_MUTEX].km);
	kl_mutex_free(subjects[K_KL_EVENTUAL].km);
	kl_lock_free(subjects[K_KL_LOCK].kl);
	kl_provider_free(subjects[K_KL_LOCK].prov);
}

void
subject_acquire(struct subject *s, const char *key, union hold *h)
{
	kl_call call = { .key = key, .cancel = NULL };
	int rc;

	switch (s->kind) {
	case K_PTHREAD:
		pthread_mutex_lock(&s->pm);
		break;
	case K_STRIPED:
		h->stripe = stripe_of(key);
		pthread_mutex_lock(h->stripe);
		break;
	case K_FIFO:
		fifo_acquire(&s->fifo);
		break;
	case K_KL_MUTEX:
	case K_KL_EVENTUAL:
		if ((rc = kl_mutex_enter(s->km, KL_FOREVER, NULL, &h->tok)) !=
		    KL_OK)
			die("kl_mutex_enter: %s", kl_strerror(rc));
		break;
	case K_KL_LOCK:
		if ((rc = kl_lock_acquire(s->kl, &call, &h->lease, NULL)) !=
		    KL_OK)
			die("kl_lock_acquire: %s", kl_strerror(rc));
		break;
	case K_NONE: /* its loop takes nothing (unlocked_loop) */
	default:
		die("no lock to take or give back");
	}
}

void
subject_release(struct subject *s, union hold *h)
{
	int rc;

	switch (s->kind) {
	case K_PTHREAD:
		pthread_mutex_unlock(&s->pm);
		break;
	case K_STRIPED:
		pthread_mutex_unlock(h->stripe);
		break;
	case K_FIFO:
		fifo_release(&s->fifo);
		break;
	case K_KL_MUTEX:
	case K_KL_EVENTUAL:
		if ((rc = kl_mutex_leave(s->km, h->tok, false)) != KL_OK)
			die("kl_mutex_leave: %s", kl_strerror(rc));
		break;
	case K_KL_LOCK:
		kl_lease_release(h->lease);
		break;
	case K_NONE: /* its loop takes nothing (unlocked_loop) */
	default:
		die("no lock to take or give back");
	}
}

/* ------------------------------------------------------------------ */
/* Keys: "user:NNNNNN" for the held set, "next:NNNNNN" for fresh ones,
 * all 11 bytes, generated once into one buffer before anything is timed. */

char *keybuf;

/* The one key of the contended runs, in writable memory so that the
 * compiler cannot hash a literal at build time for the striped table. */
char hot_key[KEY_STRIDE] = "user:123456";

const char *
key_at(size_t i)
{
	return keybuf + i * KEY_STRIDE;
}

void
keys_build(void)
{
	size_t n = opt.nkeys + opt.nfresh;

	keybuf = xcalloc(n, KEY_STRIDE);
	for (size_t i = 0; i < opt.nkeys; i++)
		snprintf(keybuf + i * KEY_STRIDE, KEY_STRIDE, "user:%06zu",
			 i % 1000000);
	for (size_t i = 0; i < opt.nfresh; i++)
		snprintf(keybuf + (opt.nkeys + i) * KEY_STRIDE, KEY_STRIDE,
			 "next:%06zu", i % 1000000);
}
