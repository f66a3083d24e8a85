/*
 * The module side of libkvwire-ucx.so (see transport/tl_module.h): the entry point, and
 * the core services that ucx_*.c, tl_base.c and tl_util.c call, forwarded to the
 * library that loaded the module. Nothing else of the core is linked in.
 */
#include "transport/tl_module.h"

#include <string.h>

static const kvw_tl_host_t *module_host;

kvw_status_t kvw__verror(kvw_status_t status, const char *fmt, va_list ap)
{
    return module_host->verror(status, fmt, ap);
}

kvw_status_t kvw__error(kvw_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    module_host->verror(status, fmt, ap);
    va_end(ap);
    return status;
}

uint64_t kvw__now_ns(void)
{
    return module_host->now_ns();
}

const char *kvw_status_string(kvw_status_t status)
{
    return module_host->status_string(status);
}

extern const kvw_tl_ops_t kvw_tl_ucx_ops;

__attribute__((visibility("default"))) const kvw_tl_ops_t *
kvw_tl_module_entry(const kvw_tl_host_t *host)
{
    if (host == NULL || host->abi != KVW_TL_MODULE_ABI ||
        host->ops_size != sizeof(kvw_tl_ops_t) || host->version == NULL ||
        strcmp(host->version, KVW_VERSION_STRING) != 0)
        return NULL;
    module_host = host;
    return &kvw_tl_ucx_ops;
}
