/*
 * The log hook (kvw_set_log_handler): a room that fails reaches the handler at level
 * WARN with its id and reason; a handler limited to ERROR does not hear it; after the
 * handler is removed nothing more arrives.
 */
#include "testkit.h"
#include "inproc.h"

#include <pthread.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int calls;
static kvw_log_level_t last_level;
static char last_msg[1024];

static void handler(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    pthread_mutex_lock(&mu);
    calls++;
    last_level = level;
    snprintf(last_msg, sizeof(last_msg), "%s", msg);
    pthread_mutex_unlock(&mu);
}

/* A room naming an instance where nothing listens fails; returns once it did. */
static void failing_room(kvw_ctx_h dctx, uint64_t id)
{
    kvw_receiver_h rv = NULL;
    kvw_status_t st = kvw_receiver_create_from(dctx, id, "127.0.0.1:1", 0, &rv);
    CHECK(st == KVW_OK, "%s", kvw_last_error());
    if (rv) {
        kvw_room_state_t s = kvw_room_wait(kvw_receiver_room(rv), kvt_tmo_ms(20000));
        CHECK(s == KVW_ROOM_FAILED, "room %llu ended %s", (unsigned long long)id,
              kvw_room_state_string(s));
        kvw_room_destroy(kvw_receiver_room(rv));
    }
}

int main(void)
{
    kvt_model_t model;
    if (ip_model("test_log_hook", &model) != 0)
        return 1;
    kvt_rank_t dst;
    CHECK(ip_rank(&model, 1, 0, 8, 2, &dst) == KVW_OK, "%s", kvw_last_error());
    kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, &dst, "tcp", NULL, false);
    p.field_mask &= ~(uint64_t)(KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP);
    kvw_ctx_h dctx = NULL;
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "%s", kvw_last_error());
    if (dctx == NULL)
        return ip_summary("test_log_hook");

    kvw_set_log_handler(handler, NULL, KVW_LOG_ERROR);
    failing_room(dctx, 7);
    pthread_mutex_lock(&mu);
    CHECK(calls == 0, "a WARN reached a handler limited to ERROR: %s", last_msg);
    pthread_mutex_unlock(&mu);

    kvw_set_log_handler(handler, NULL, KVW_LOG_INFO);
    failing_room(dctx, 8);
    pthread_mutex_lock(&mu);
    CHECK(calls >= 1 && last_level == KVW_LOG_WARN &&
              kvt_contains(last_msg, "decode room 8 failed") &&
              kvt_contains(last_msg, "127.0.0.1:1"),
          "after a failed room: %d calls, level %d, '%s'", calls, (int)last_level, last_msg);
    int before = calls;
    pthread_mutex_unlock(&mu);

    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG);
    failing_room(dctx, 9);
    pthread_mutex_lock(&mu);
    CHECK(calls == before, "%d calls after the handler was removed: '%s'", calls - before,
          last_msg);
    pthread_mutex_unlock(&mu);
    kvw_ctx_destroy(dctx);
    kvt_rank_free(&dst);
    return ip_summary("test_log_hook");
}
