/* Random and consecutive page tables for test requests. */
#include "testkit.h"

#include <stdlib.h>
#include <string.h>

int kvt_pages_random(kvt_rng_t *rng, uint32_t pool_pages, uint32_t count, uint32_t *out)
{
    if (count > pool_pages)
        return -1;
    if (count == 0)
        return 0;
    /* Partial Fisher-Yates over the whole pool: distinct by construction. */
    uint32_t *all = malloc((size_t)pool_pages * sizeof(*all));
    if (!all)
        return -1;
    for (uint32_t i = 0; i < pool_pages; i++)
        all[i] = i;
    for (uint32_t i = 0; i < count; i++) {
        uint32_t j = i + (uint32_t)kvt_rng_below(rng, pool_pages - i);
        uint32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        out[i] = all[i];
    }
    free(all);
    return 0;
}

void kvt_pages_consecutive(uint32_t start, uint32_t count, uint32_t *out)
{
    for (uint32_t i = 0; i < count; i++)
        out[i] = start + i;
}

/* Fills one pool's page list covering tokens [begin, end) with `ps`-token pages. */
static int kvt_pool_pages(uint64_t begin, uint64_t end, uint32_t ps, uint32_t pool_pages,
                          int consecutive, uint32_t start, kvt_rng_t *rng, kvw_pages_t *p,
                          uint32_t **store)
{
    memset(p, 0, sizeof(*p));
    *store = NULL;
    if (end <= begin || ps == 0)
        return 0;
    uint64_t first = begin / ps * ps;
    uint64_t n = (end - first + ps - 1) / ps;
    if (n > pool_pages)
        return -1;
    uint32_t *pages = malloc(n * sizeof(*pages));
    if (!pages)
        return -1;
    if (consecutive) {
        if (start + n > pool_pages) {
            free(pages);
            return -1;
        }
        kvt_pages_consecutive(start, (uint32_t)n, pages);
    } else if (kvt_pages_random(rng, pool_pages, (uint32_t)n, pages)) {
        free(pages);
        return -1;
    }
    p->field_mask = KVW_PAGES_FIELDS_ALL;
    p->pages = pages;
    p->num_pages = (uint32_t)n;
    p->first_token = first;
    *store = pages;
    return 0;
}

/* Pages in a pool: buffer length / page bytes of any buffer of that pool (the builder
 * gives every buffer of a pool the same page count). */
static uint32_t kvt_pool_size(const kvt_rank_t *rank, kvw_pool_t pool)
{
    for (uint32_t i = 0; i < rank->num_bufs; i++) {
        const kvw_buffer_desc_t *b = &rank->bufs[i];
        if (b->pool != pool)
            continue;
        uint64_t page = (uint64_t)b->page_size * b->num_heads * (b->head_bytes + b->v_head_bytes);
        return page ? (uint32_t)(b->length / page) : 0;
    }
    return 0;
}

int kvt_req_pages_make(const kvt_rank_t *rank, const kvt_req_spec_t *spec, kvt_rng_t *rng,
                       kvt_req_pages_t *pages_p)
{
    kvt_req_pages_t r;
    memset(&r, 0, sizeof(r));
    uint32_t nfull = kvt_pool_size(rank, KVW_POOL_FULL);
    uint32_t nswa = kvt_pool_size(rank, KVW_POOL_SWA);
    /* A rank may hold no buffer of a pool (a PP stage without SWA layers); it still
     * gets a page list so that requests look the same on every stage. */
    if (nfull == 0)
        nfull = UINT32_MAX / 2;
    if (nswa == 0)
        nswa = UINT32_MAX / 2;
    if (kvt_pool_pages(spec->full_begin, spec->full_end, rank->page_size[KVW_POOL_FULL], nfull,
                       spec->consecutive || nfull == UINT32_MAX / 2, spec->full_start, rng,
                       &r.side.full, &r.full))
        goto err;
    if (kvt_pool_pages(spec->swa_begin, spec->swa_end, rank->page_size[KVW_POOL_SWA], nswa,
                       spec->consecutive || nswa == UINT32_MAX / 2, spec->swa_start, rng,
                       &r.side.swa, &r.swa))
        goto err;
    r.side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
    r.side.state_slot = spec->state_slot;
    *pages_p = r;
    return 0;
err:
    kvt_req_pages_free(&r);
    return -1;
}

void kvt_req_pages_free(kvt_req_pages_t *pages)
{
    free(pages->full);
    free(pages->swa);
    memset(pages, 0, sizeof(*pages));
}
