/* SPDX-License-Identifier: MIT */
/*
 * test/cli/list_fmt: what `keylock list` prints for keys no provider of the
 * tree can be made to hold at will (control bytes, bytes that are not
 * UTF-8, a key the provider cannot name, a waiter whose process is
 * unknown), and its message for a provider that cannot list.  Includes
 * tools/keylock.c (as test/fuzz/fuzz_cli.c does) and runs its list_locks
 * on a user provider whose snapshot reports fixed entries.
 *
 *   list_fmt table|json   the listing of the entries below
 *   list_fmt none URI     a provider without a snapshot member, named URI
 *   list_fmt fail URI     a snapshot that fails with KL_EPROVIDER
 * Exits with list_locks' status.  Run by test/cli/list_format.sh.
 */
#define main keylock_main
int keylock_main(int argc, char **argv);
#include "../../tools/keylock.c"
#undef main

struct fake {
	const char *key; /* NULL: the provider cannot name it */
	size_t key_len;
	const char *detail;
	bool waiting, shared;
	int64_t pid, tid;
	uint64_t fence;
	int64_t elapsed_ms;
	size_t position;
};

#define S(s) s, sizeof s - 1

static char long_key[301];

static struct fake fakes[] = {
	{ S("k"), NULL, false, false, 100, 101, 7, 1500, 0 },
	{ S("k"), NULL, true, true, 102, 102, 0, 20, 0 },
	{ S("k"), NULL, true, false, 0, 0, 0, -1, 1 },
	{ S("a\nb\tc\\d\x1b[31m"), NULL, false, true, 103, 104, 3, 61000, 0 },
	{ S("caf\xc3\xa9"), NULL, false, true, 105, 105, 4, 0, 0 },
	{ S("\xff\xfe" "bad"), NULL, false, false, 106, 106, 5, 3700000, 0 },
	{ NULL, 300, NULL, false, false, 107, 107, 6, 5, 0 }, /* long_key */
	{ NULL, 0, "advisory lock 42\n\x1b]0;x\x07", false, false, 108, 0, 9,
	  90000000, 0 },
	{ S("\xe2\x80\xa8\xc2\x85" "\"q\""), NULL, true, false, 109, 109, 0,
	  10, 0 },
	/* Redis's names of two locks under a prefix of 50 characters. */
	{ NULL, 0, "app:production:eu-west-1:billing:report-scheduler:"
		   "{0123456789abcdef}", false, false, 0, 0, 11, 20, 0 },
	{ NULL, 0, "app:production:eu-west-1:billing:report-scheduler:"
		   "{fedcba9876543210}", false, false, 0, 0, 12, 20, 0 },
};

#define NFAKES (sizeof fakes / sizeof fakes[0])

static int
fake_snapshot(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	(void)impl;
	(void)err;
	for (size_t i = 0; i < NFAKES; i++) {
		kl_lock_info info = {
			.key = i == 6 ? long_key : fakes[i].key,
			.key_len = fakes[i].key_len,
			.detail = fakes[i].detail,
			.waiting = fakes[i].waiting,
			.shared = fakes[i].shared,
			.pid = fakes[i].pid,
			.tid = fakes[i].tid,
			.fence = fakes[i].fence,
			.elapsed_ms = fakes[i].elapsed_ms,
			.position = fakes[i].position,
		};

		if (fn(&info, arg) != 0)
			break;
	}
	return KL_OK;
}

static int
fake_fail(void *impl, kl_snapshot_fn fn, void *arg, kl_error *err)
{
	(void)impl;
	(void)fn;
	(void)arg;
	snprintf(err->message, sizeof err->message,
		 "the server refused the listing");
	err->status = KL_EPROVIDER;
	return KL_EPROVIDER;
}

/* Never called: list_locks only lists. */
static int
fake_acquire(void *impl, const char *key, size_t key_len, kl_cancel *cancel,
	     int64_t timeout_ms, int64_t ttl_ms, unsigned flags, void **lease,
	     uint64_t *fence, kl_error *err)
{
	(void)impl, (void)key, (void)key_len, (void)cancel, (void)timeout_ms;
	(void)ttl_ms, (void)flags, (void)lease, (void)fence, (void)err;
	return KL_EPROVIDER;
}

static int
fake_release(void *impl, void *lease, kl_error *err)
{
	(void)impl, (void)lease, (void)err;
	return KL_EPROVIDER;
}

int
main(int argc, char **argv)
{
	kl_provider_ops ops = {
		.struct_size = sizeof ops,
		.name = "fake",
		.acquire = fake_acquire,
		.release = fake_release,
	};
	struct options o = { .provider = "fake:" };
	kl_provider *p;
	int code;

	if (argc < 2) {
		fputs("usage: list_fmt table|json|none URI|fail URI\n", stderr);
		return 99;
	}
	memset(long_key, 'L', 300);
	if (strcmp(argv[1], "json") == 0)
		o.json = true;
	if (strcmp(argv[1], "none") == 0 || strcmp(argv[1], "fail") == 0) {
		if (argc < 3)
			return 99;
		o.provider = argv[2];
		if (strcmp(argv[1], "fail") == 0)
			ops.snapshot = fake_fail;
	} else {
		ops.snapshot = fake_snapshot;
	}
	if (kl_provider_new(&p, &ops, NULL) != KL_OK)
		return 99;
	code = list_locks(&o, p);
	kl_provider_free(p);
	return code;
}
