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

/* A table with a required slot left NULL is refused where it is found, not at the first
 * call through the slot (only rkey_ptr is optional). */
static const kvw_tl_ops_t *tl_checked(const kvw_tl_ops_t *ops)
{
    if (ops == NULL)
        return NULL;
    const struct {
        const char *slot;
        bool set;
    } req[] = {{"init", ops->init},           {"address", ops->address},
               {"mem_reg", ops->mem_reg},     {"mem_dereg", ops->mem_dereg},
               {"connect", ops->connect},     {"rkey_unpack", ops->rkey_unpack},
               {"rkey_release", ops->rkey_release}, {"put", ops->put},
               {"notify", ops->notify},       {"ep_close", ops->ep_close},
               {"close", ops->close},         {"stop", ops->stop},
               {"fini", ops->fini}};
    for (size_t i = 0; i < KVW_ARRAY_SIZE(req); i++)
        if (!req[i].set) {
            kvw__error(KVW_ERR_INTERNAL, "transport '%s' leaves its required slot '%s' empty",
                       ops->name ? ops->name : "?", req[i].slot);
            return NULL;
        }
    return ops;
}

static const kvw_tl_ops_t *tl_find(const char *name);

const kvw_tl_ops_t *kvw__tl_find(const char *name)
{
    return tl_checked(tl_find(name));
}

static const kvw_tl_ops_t *tl_find(const char *name)
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
