/*
 * The CUDA module's operations table, loaded once per process (src/core/cuda_rt.c).
 */
#ifndef KVW_CORE_CUDA_RT_H
#define KVW_CORE_CUDA_RT_H

#include "core/core.h"
#include "cuda/module.h"

/* The module's table, loading it on the first call; UNSUPPORTED with the loader's reason
 * when it cannot be loaded. */
kvw_status_t kvw__cuda_get(const kvwc_ops_t **ops_p);

/* Passes a module status up, copying its message into this thread's error. */
kvw_status_t kvw__cuda_ret(const kvwc_ops_t *ops, kvw_status_t st);

/* The body of a call forwarded to the module: load it, call, pass the status up. */
#define KVW_CUDA_FORWARD(call)                                                           \
    const kvwc_ops_t *ops = NULL;                                                        \
    kvw_status_t st_ = kvw__cuda_get(&ops);                                               \
    if (st_ != KVW_OK)                                                                   \
        return st_;                                                                      \
    return kvw__cuda_ret(ops, ops->call)

#endif
