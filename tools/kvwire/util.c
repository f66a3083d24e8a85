/* Helpers shared by the CLI's subcommands (see util.h). */
#include "util.h"

#include <kvwire/cuda.h>
#include <kvwire/xfer.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

kvw_ctx_h *cli_contexts(const kvw_ctx_params_t *tmpl, kvt_rank_t *ranks, uint32_t n,
                        bool prefill, const char *bs_addr, char *bs_out, size_t bs_cap,
                        uint32_t *failed, char *why, size_t why_cap)
{
    kvw_ctx_h *ctx = calloc(n ? n : 1, sizeof(*ctx));
    if (ctx == NULL) {
        *failed = 0;
        snprintf(why, why_cap, "%s: no memory for %u contexts",
                 kvw_status_string(KVW_ERR_NO_MEMORY), n);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        kvw_ctx_params_t p = *tmpl;
        p.side = prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE;
        p.rank = ranks[i].h;
        p.bootstrap_addr = bs_addr;
        p.host_bootstrap = prefill && i == 0;
        kvw_status_t st = kvw_ctx_create(&p, &ctx[i]);
        if (st != KVW_OK) {
            *failed = i;
            snprintf(why, why_cap, "%s: %s", kvw_status_string(st), kvw_last_error());
            for (uint32_t j = 0; j < i; j++)
                kvw_ctx_destroy(ctx[j]);
            free(ctx);
            return NULL;
        }
        if (prefill && i == 0) {
            snprintf(bs_out, bs_cap, "%s", kvw_ctx_bootstrap_addr(ctx[0]));
            bs_addr = bs_out;
        }
    }
    return ctx;
}
