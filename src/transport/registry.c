/* The table of transports compiled into this library. */
#include "transport/transport.h"

#include <string.h>

extern const kvw_tl_ops_t kvw_tl_tcp_ops;
extern const kvw_tl_ops_t kvw_tl_shm_ops;
#ifdef KVW_HAVE_UCX
extern const kvw_tl_ops_t kvw_tl_ucx_ops;
#endif
/* Found by name but not listed: it needs a GPU at run time, which most machines that run
 * the transport conformance suite lack (kvwire info reports whether it works here). */
extern const kvw_tl_ops_t kvw_tl_cuda_ipc_ops;

/* Same order in both tables; the names are spelled out so kvw__tl_names() can hand
 * out a static NULL-terminated array. */
static const kvw_tl_ops_t *const tl_table[] = {
    &kvw_tl_tcp_ops,
    &kvw_tl_shm_ops,
#ifdef KVW_HAVE_UCX
    &kvw_tl_ucx_ops,
#endif
};

static const char *const tl_names[] = {
    "tcp",
    "shm",
#ifdef KVW_HAVE_UCX
    "ucx",
#endif
    NULL,
};

_Static_assert(KVW_ARRAY_SIZE(tl_names) == KVW_ARRAY_SIZE(tl_table) + 1,
               "tl_names and tl_table must list the same transports");

/* Atomic only so that a late install is not a data race; see transport.h. */
static const kvw_tl_resolver_t *tl_resolver;

void kvw__tl_set_resolver(const kvw_tl_resolver_t *resolver)
{
    __atomic_store_n(&tl_resolver, resolver, __ATOMIC_RELEASE);
}

const kvw_tl_ops_t *kvw__tl_find(const char *name)
{
    if (name == NULL) {
        kvw__error(KVW_ERR_INVALID_PARAM, "transport name is NULL");
        return NULL;
    }
    for (size_t i = 0; i < KVW_ARRAY_SIZE(tl_table); i++) {
        if (strcmp(tl_table[i]->name, name) == 0)
            return tl_table[i];
    }
    if (strcmp(name, kvw_tl_cuda_ipc_ops.name) == 0)
        return &kvw_tl_cuda_ipc_ops;
    const kvw_tl_resolver_t *r = __atomic_load_n(&tl_resolver, __ATOMIC_ACQUIRE);
    if (r != NULL && strncmp(name, r->prefix, strlen(r->prefix)) == 0)
        return r->find(name);
    kvw__error(KVW_ERR_NOT_FOUND, "transport '%s' is not compiled into this library", name);
    return NULL;
}

const char *const *kvw__tl_names(void)
{
    return tl_names;
}

kvw_status_t kvw__tl_unsupported(void)
{
    return kvw__error(KVW_ERR_UNSUPPORTED, "operation not supported by this transport");
}
