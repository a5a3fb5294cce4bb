# SPDX-License-Identifier: MIT
# Section-3 manual pages: one page per object, and a one-line .so page
# per public function.  Included by the top Makefile.am.

dist_man_MANS = \
	man/keylock.1 \
	man/keylock-bench.1 \
	man/keylock.3 \
	man/kl_cancel.3 \
	man/kl_mutex.3 \
	man/kl_reset_event.3 \
	man/kl_registry.3 \
	man/kl_lock.3 \
	man/kl_provider.3 \
	man/kl_cancel_fire.3 \
	man/kl_cancel_fired.3 \
	man/kl_cancel_free.3 \
	man/kl_cancel_new.3 \
	man/kl_cancel_new_timeout.3 \
	man/kl_deadlock_ms.3 \
	man/kl_deadlock_ms_set.3 \
	man/kl_duration_parse.3 \
	man/kl_lease_count.3 \
	man/kl_lease_fence.3 \
	man/kl_lease_fence_at.3 \
	man/kl_lease_key.3 \
	man/kl_lease_key_at.3 \
	man/kl_lease_release.3 \
	man/kl_lease_valid.3 \
	man/kl_lock_acquire.3 \
	man/kl_lock_acquire_many.3 \
	man/kl_lock_free.3 \
	man/kl_lock_new.3 \
	man/kl_lock_run.3 \
	man/kl_lock_run_lease.3 \
	man/kl_lock_run_many.3 \
	man/kl_memory_provider.3 \
	man/kl_memory_provider_new.3 \
	man/kl_memory_provider_queue_size.3 \
	man/kl_memory_provider_size.3 \
	man/kl_mutex_enter.3 \
	man/kl_mutex_free.3 \
	man/kl_mutex_get_opts.3 \
	man/kl_mutex_is_locked.3 \
	man/kl_mutex_leave.3 \
	man/kl_mutex_new.3 \
	man/kl_mutex_queue_size.3 \
	man/kl_mutex_run.3 \
	man/kl_mutex_set_opts.3 \
	man/kl_mutex_try_enter.3 \
	man/kl_named_exists.3 \
	man/kl_named_get_opts.3 \
	man/kl_named_is_locked.3 \
	man/kl_named_queue_size.3 \
	man/kl_named_remove.3 \
	man/kl_named_run.3 \
	man/kl_named_run_cancel.3 \
	man/kl_named_set_opts.3 \
	man/kl_provider_free.3 \
	man/kl_provider_new.3 \
	man/kl_provider_open.3 \
	man/kl_provider_snapshot.3 \
	man/kl_provider_status.3 \
	man/kl_queue_opts_default.3 \
	man/kl_queue_opts_set_default.3 \
	man/kl_registry_free.3 \
	man/kl_registry_new.3 \
	man/kl_reset_event_free.3 \
	man/kl_reset_event_is_signaled.3 \
	man/kl_reset_event_new.3 \
	man/kl_reset_event_queue_size.3 \
	man/kl_reset_event_reset.3 \
	man/kl_reset_event_set.3 \
	man/kl_reset_event_wait.3 \
	man/kl_strerror.3 \
	man/kl_token_elapsed_ms.3 \
	man/kl_version.3

# The PostgreSQL provider (libkeylock-pg).
dist_man_MANS += \
	man/kl_pg_provider_open.3 \
	man/kl_pg_key_id.3

# The Redis provider (libkeylock-redis).
dist_man_MANS += \
	man/kl_redis_provider_open.3
