/* Helpers shared by the CLI's subcommands (see util.h). */
#include "util.h"

#include <kvwire/cuda.h>
#include <kvwire/xfer.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

int cli_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

uint64_t cli_median(const uint64_t *v, uint32_t n)
{
    if (n == 0)
        return 0;
    uint64_t *t = malloc(sizeof(uint64_t) * n);
    if (t == NULL)
        return 0;
    memcpy(t, v, sizeof(uint64_t) * n);
    qsort(t, n, sizeof(uint64_t), cli_cmp_u64);
    uint64_t r = n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
    free(t);
    return r;
}

bool cli_room_ended(kvw_room_state_t s)
{
    return s == KVW_ROOM_SUCCESS || s == KVW_ROOM_FAILED;
}

uint64_t cli_swa_window(const kvt_model_t *m)
{
    uint64_t w = 0;
    for (uint32_t l = 0; l < m->m.num_layers; l++)
        if (m->layers[l].kind == KVW_LAYER_SWA && m->layers[l].window > w)
            w = m->layers[l].window;
    return w;
}

uint32_t cli_pages_needed(uint64_t b, uint64_t e, uint32_t ps)
{
    return b >= e ? 0 : (uint32_t)((e + ps - 1) / ps - b / ps);
}

void cli_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

/* The wait a context's creation may take, for its progress line (0: unknown). */
static uint32_t cli_wait_limit_s(const kvw_ctx_params_t *p)
{
    if ((p->field_mask & KVW_CTX_FIELD_TIMEOUTS) && p->bootstrap_timeout_ms)
        return (p->bootstrap_timeout_ms + 999) / 1000;
    return 0;
}

kvw_ctx_h *cli_contexts(const char *who, const kvw_ctx_params_t *tmpl, kvt_rank_t *ranks,
                        uint32_t n, bool prefill, bool external_bs, const char *bs_addr,
                        char *bs_out, size_t bs_cap, uint32_t *failed, kvw_status_t *status_p,
                        char *why, size_t why_cap)
{
    kvw_ctx_h *ctx = calloc(n ? n : 1, sizeof(*ctx));
    if (status_p)
        *status_p = KVW_OK;
    if (ctx == NULL) {
        *failed = 0;
        if (status_p)
            *status_p = KVW_ERR_NO_MEMORY;
        snprintf(why, why_cap, "%s: no memory for %u contexts",
                 kvw_status_string(KVW_ERR_NO_MEMORY), n);
        return NULL;
    }
    if (prefill && external_bs && bs_out)
        snprintf(bs_out, bs_cap, "%s", bs_addr);
    for (uint32_t i = 0; i < n; i++) {
        kvw_ctx_params_t p = *tmpl;
        p.side = prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE;
        p.rank = ranks[i].h;
        p.bootstrap_addr = bs_addr;
        p.host_bootstrap = prefill && i == 0 && !external_bs;
        char what[256];
        if (prefill)
            snprintf(what, sizeof(what), "prefill rank %u registering at the bootstrap endpoint "
                     "%s", i, bs_addr);
        else
            snprintf(what, sizeof(what), "decode rank %u waiting for the prefill ranks at %s "
                     "(they register there; the decode registers with each)", i, bs_addr);
        cli_ticker_t *tk = p.host_bootstrap || who == NULL
                               ? NULL
                               : cli_ticker_start(who, 5, cli_wait_limit_s(&p), what);
        kvw_status_t st = kvw_ctx_create(&p, &ctx[i]);
        cli_ticker_stop(tk);
        if (st != KVW_OK) {
            *failed = i;
            if (status_p)
                *status_p = st;
            snprintf(why, why_cap, "%s: %s", kvw_status_string(st), kvw_last_error());
            for (uint32_t j = 0; j < i; j++)
                kvw_ctx_destroy(ctx[j]);
            free(ctx);
            return NULL;
        }
        if (prefill && i == 0 && !external_bs) {
            snprintf(bs_out, bs_cap, "%s", kvw_ctx_bootstrap_addr(ctx[0]));
            bs_addr = bs_out;
        }
    }
    return ctx;
}

/* ---------------------------------------------------------------- option values */

int cli_opt_u64(const char *who, const char *opt, const char *text, uint64_t min, uint64_t max,
                uint64_t *out)
{
    /* Digits only: strtoull alone takes blanks, a sign ("-1" is 2^64 - 1) and trailing
     * junk. */
    bool ok = text && *text && strspn(text, "0123456789") == strlen(text) && strlen(text) <= 20;
    unsigned long long v = 0;
    if (ok) {
        errno = 0;
        v = strtoull(text, NULL, 10);
        ok = errno == 0 && v >= min && v <= max;
    }
    if (!ok) {
        fprintf(stderr, "%s: %s takes a whole number from %llu to %llu, not '%s'\n", who, opt,
                (unsigned long long)min, (unsigned long long)max, text ? text : "");
        return -1;
    }
    *out = v;
    return 0;
}

int cli_opts_end(const char *who, const char *help, int bad, int optind_, int argc,
                 char **argv)
{
    if (bad)
        return 2;
    if (optind_ < argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (%s lists the options)\n", who,
                argv[optind_], help);
        return 2;
    }
    return 0;
}

int cli_opt_u32(const char *who, const char *opt, const char *text, uint32_t min, uint32_t max,
                uint32_t *out)
{
    uint64_t v;
    if (cli_opt_u64(who, opt, text, min, max, &v))
        return -1;
    *out = (uint32_t)v;
    return 0;
}

int cli_opt_choice(const char *who, const char *opt, const char *text,
                   const char *const *choices, int *index_p)
{
    for (int i = 0; choices[i]; i++)
        if (text && !strcasecmp(text, choices[i])) {
            *index_p = i;
            return 0;
        }
    fprintf(stderr, "%s: %s takes ", who, opt);
    for (int i = 0; choices[i]; i++)
        fprintf(stderr, "%s%s", i == 0 ? "" : choices[i + 1] ? ", " : " or ", choices[i]);
    fprintf(stderr, ", not '%s'\n", text ? text : "");
    return -1;
}

int cli_opt_hostport(const char *who, const char *opt, const char *text, uint32_t min_port)
{
    const char *colon = text ? strrchr(text, ':') : NULL;
    size_t hlen = colon ? (size_t)(colon - text) : 0;
    bool digits = colon && colon[1] && strspn(colon + 1, "0123456789") == strlen(colon + 1) &&
                  strlen(colon + 1) <= 5;
    unsigned long port = digits ? strtoul(colon + 1, NULL, 10) : 0;
    if (!colon || hlen == 0 || hlen > 127 || !digits || port < min_port || port > 65535) {
        fprintf(stderr, "%s: %s takes HOST:PORT (a host name or address, a port from %u to "
                "65535), not '%s'\n", who, opt, min_port, text ? text : "");
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- progress */

struct cli_ticker {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    char who[64], what[320];
    uint32_t every_s, limit_s;
    uint64_t t0;
};

static void *cli_ticker_main(void *arg)
{
    cli_ticker_t *t = arg;
    pthread_mutex_lock(&t->mu);
    for (uint32_t k = 1; !t->stop; k++) {
        struct timespec dl;
        clock_gettime(CLOCK_MONOTONIC, &dl);
        uint64_t due = t->t0 + (uint64_t)k * t->every_s * 1000000000ull;
        dl.tv_sec = (time_t)(due / 1000000000ull);
        dl.tv_nsec = (long)(due % 1000000000ull);
        while (!t->stop && pthread_cond_timedwait(&t->cv, &t->mu, &dl) != ETIMEDOUT) {
        }
        if (t->stop)
            break;
        uint32_t s = k * t->every_s;
        if (t->limit_s)
            fprintf(stderr, "%s: %s, %u s of %u s\n", t->who, t->what, s, t->limit_s);
        else
            fprintf(stderr, "%s: %s, %u s\n", t->who, t->what, s);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

cli_ticker_t *cli_ticker_start(const char *who, uint32_t every_s, uint32_t limit_s,
                               const char *what)
{
    cli_ticker_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&t->mu, NULL);
    snprintf(t->who, sizeof(t->who), "%s", who);
    snprintf(t->what, sizeof(t->what), "%s", what);
    t->every_s = every_s ? every_s : 5;
    t->limit_s = limit_s;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    t->t0 = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    if (pthread_create(&t->th, NULL, cli_ticker_main, t) != 0) {
        pthread_cond_destroy(&t->cv);
        pthread_mutex_destroy(&t->mu);
        free(t);
        return NULL;
    }
    return t;
}

void cli_ticker_stop(cli_ticker_t *t)
{
    if (t == NULL)
        return;
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->th, NULL);
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

double cli_secs_since(uint64_t t0_ns)
{
    return (double)(kvt_now_ns() - t0_ns) / 1e9;
}
