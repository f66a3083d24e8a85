/*
 * Transports built as modules: shared objects that libkvwire loads at run time (dlopen),
 * so that the core library has no link dependency on what they need. UCX is one: a
 * program that moves bytes over tcp or shm never loads libucp.
 *
 * A module is libkvwire-NAME.so. It exports one function, KVW_TL_MODULE_ENTRY, which
 * the loader calls once with the host's services; it returns its transport table, or
 * NULL when it was built for another library (ABI, table size or version differ). The
 * module and the library are built from one tree and installed side by side.
 *
 * The host services are the few core functions a transport uses: errors go through the
 * host's kvw__verror so that kvw_last_error() of the calling thread shows them, and
 * time comes from the host's clock so that deadlines compare, status texts from its
 * table.
 */
#ifndef KVW_TRANSPORT_TL_MODULE_H
#define KVW_TRANSPORT_TL_MODULE_H

#include "transport/transport.h"

#include <stdarg.h>

#define KVW_TL_MODULE_ABI 2 /* 2: the progress slot left kvw_tl_ops_t; check_write names the
                             * endpoint; instance_caps */
#define KVW_TL_MODULE_ENTRY "kvw_tl_module_entry"

typedef struct kvw_tl_host {
    uint32_t abi;        /* KVW_TL_MODULE_ABI */
    uint32_t ops_size;   /* sizeof(kvw_tl_ops_t) */
    const char *version; /* KVW_VERSION_STRING of the library */
    kvw_status_t (*verror)(kvw_status_t status, const char *fmt, va_list ap);
    uint64_t (*now_ns)(void);
    const char *(*status_string)(kvw_status_t status);
} kvw_tl_host_t;

/* The entry point's type. `host` stays valid while the module is loaded. */
typedef const kvw_tl_ops_t *(*kvw_tl_module_entry_fn)(const kvw_tl_host_t *host);

/*
 * Loads libkvwire-NAME.so (once per process; later calls return the same result) and
 * returns its table. Looks in $KVW_TL_MODULE_DIR when set (only there), else next to the
 * object that holds libkvwire (the shared library, or a program linked with the static
 * one), then in the library directory relative to a program installed in bin/, then
 * through the dynamic loader's search path. NULL with an error (NOT_FOUND, INCOMPATIBLE)
 * that says where it looked and why each failed.
 */
const kvw_tl_ops_t *kvw__tl_module_load(const char *name);

#endif
