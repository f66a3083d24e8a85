/*
 * The transports of this library: tcp and shm are compiled in; ucx is a module
 * (libkvwire-ucx.so, see tl_module.h) loaded the first time it is asked for, so that
 * the library itself does not link UCX.
 */
#include "transport/tl_module.h"
#include "transport/transport.h"

#include <kvwire/xfer.h>

#include <pthread.h>
#include <string.h>

extern const kvw_tl_ops_t kvw_tl_tcp_ops;
extern const kvw_tl_ops_t kvw_tl_shm_ops;
/* Found by name but not listed: it needs a GPU at run time, which most machines that run
 * the transport conformance suite lack (kvwire info reports whether it works here). */
extern const kvw_tl_ops_t kvw_tl_cuda_ipc_ops;

static const kvw_tl_ops_t *const tl_table[] = {
    &kvw_tl_tcp_ops,
    &kvw_tl_shm_ops,
};

/* Transports built as modules with this library (NULL-terminated); listed only where
 * they load. */
static const char *const tl_module_names[] = {
#ifdef KVW_HAVE_UCX
    "ucx",
#endif
    NULL,
};

/* Built-in names, then the modules that loaded; NULL-terminated. */
static const char *tl_names[KVW_ARRAY_SIZE(tl_table) + KVW_ARRAY_SIZE(tl_module_names)];
static pthread_once_t tl_names_once = PTHREAD_ONCE_INIT;

static void tl_names_fill(void)
{
    size_t n = 0;
    for (size_t i = 0; i < KVW_ARRAY_SIZE(tl_table); i++)
        tl_names[n++] = tl_table[i]->name;
    for (size_t i = 0; tl_module_names[i] != NULL; i++)
        if (kvw__tl_module_load(tl_module_names[i]) != NULL)
            tl_names[n++] = tl_module_names[i];
    tl_names[n] = NULL;
}

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
    for (size_t i = 0; tl_module_names[i] != NULL; i++)
        if (strcmp(name, tl_module_names[i]) == 0)
            return kvw__tl_module_load(name); /* NULL with the reason */
    const kvw_tl_resolver_t *r = __atomic_load_n(&tl_resolver, __ATOMIC_ACQUIRE);
    if (r != NULL && strncmp(name, r->prefix, strlen(r->prefix)) == 0)
        return r->find(name);
    kvw__error(KVW_ERR_NOT_FOUND, "transport '%s' is not compiled into this library", name);
    return NULL;
}

const char *const *kvw__tl_names(void)
{
    pthread_once(&tl_names_once, tl_names_fill);
    return tl_names;
}

const char *const *kvw_transport_names(void)
{
    return kvw__tl_names();
}

/* Environment variables kvwire reads, in one table (name, default, help). */
static const kvw_config_var_t kvw_config_table[] = {
    {"KVW_CUDA_MODULE", "libkvwire_cuda.so next to libkvwire",
     "path of the CUDA module loaded at run time"},
    {"KVW_TL_MODULE_DIR", "next to libkvwire, ../lib, loader path",
     "the only directory searched for transport modules (libkvwire-ucx.so)"},
    {"KVW_UCX_TIMEOUT_MS", "10000", "deadline of every UCX wait (flush, put, notify)"},
    {"KVW_UCX_PUT", "am", "am: writes as active messages the receiver applies; rma: ucp_put"},
    {"KVW_UCX_ERR_MODE", "peer", "peer: detect dead peers (UCX then uses tcp lanes); none"},
    {"KVW_WORKERS", "4", "prefill sender threads per context (decode ranks served in parallel)"},
    {"KVW_GPU_INFLIGHT", "8", "GPU copy kernels in flight per sender thread (1..8; 1 waits for each)"},
    {"KVW_STAGING_MB", "64", "decode staging area for gathered head slices, per rank"},
    {"KVW_PATH", "auto", "direct | staged: force the data path of every plan"},
    {"KVW_BUSY_POLL_US", "0", "spin this long for the next event before sleeping (latency)"},
    {"UCX_TLS", "(UCX default)", "UCX transports to use; set tcp across network namespaces"},
};

const kvw_config_var_t *kvw_config_vars(size_t *count_p)
{
    if (count_p)
        *count_p = sizeof(kvw_config_table) / sizeof(kvw_config_table[0]);
    return kvw_config_table;
}

kvw_status_t kvw__tl_unsupported(void)
{
    return kvw__error(KVW_ERR_UNSUPPORTED, "operation not supported by this transport");
}
