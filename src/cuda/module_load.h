/*
 * Finding and loading the CUDA module (libkvwire_cuda.so), shared by the library's
 * loader (src/exec/cuda_loader.c) and the test kit's CUDA helpers
 * (tools/testkit/cuda_mod.c): both load the same file by the same rule and refuse the
 * same mismatches, so that a tool's own device copies and the library's kernels always
 * run in one module (one CUDA runtime, or the CPU stand-in of tests/gpu/).
 *
 * The rule: the path `env_path` (the setting KVW_CUDA_MODULE) when it is not empty;
 * else the module file in the directory of the object that holds `anchor` (an address
 * inside libkvwire.so, or inside the executable a static libkvwire was linked into,
 * found through /proc/self/exe);
 * else the dynamic loader's search path. The module's table must carry this header's
 * ABI number and size.
 */
#ifndef KVW_CUDA_MODULE_LOAD_H
#define KVW_CUDA_MODULE_LOAD_H

#include "cuda/module.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Tries one path; on failure appends the loader's reason to msg ("; "-separated). */
static inline void *kvwc_module_try(const char *path, char *msg, size_t cap)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        size_t used = strlen(msg);
        const char *why = dlerror();
        /* Appended by hand: the message may be cut, and the compiler need not warn. */
        const char *parts[2] = {used ? "; " : "", why ? why : path};
        for (int k = 0; k < 2; k++)
            for (const char *c = parts[k]; *c && used + 1 < cap; c++)
                msg[used++] = *c;
        msg[used] = '\0';
    }
    return h;
}

/*
 * Loads the module by the rule above and returns its operations table; the module
 * stays loaded for the life of the process. NULL when none loads or its table does not
 * match, with the reasons in msg (cap bytes, at least 1).
 */
static inline const kvwc_ops_t *kvwc_module_load(const char *env_path, const void *anchor,
                                                 char *msg, size_t cap)
{
    void *h = NULL;
    msg[0] = '\0';
    if (env_path != NULL && *env_path) {
        h = kvwc_module_try(env_path, msg, cap);
    } else {
        Dl_info info;
        char self[4096];
        if (dladdr(anchor, &info) && info.dli_fname) {
            /* The main program's name comes back empty (or as it was started, without
             * a directory): a static libkvwire linked into a program looks beside that
             * program's file. */
            if (strchr(info.dli_fname, '/') == NULL) {
                ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
                self[n > 0 ? n : 0] = '\0';
                info.dli_fname = self;
            }
            char path[4096];
            const char *slash = strrchr(info.dli_fname, '/');
            if (slash) {
                int n = snprintf(path, sizeof(path), "%.*s/%s", (int)(slash - info.dli_fname),
                                 info.dli_fname, KVWC_MODULE_FILE);
                if (n > 0 && (size_t)n < sizeof(path))
                    h = kvwc_module_try(path, msg, cap);
            }
        }
        if (h == NULL)
            h = kvwc_module_try(KVWC_MODULE_FILE, msg, cap);
    }
    if (h == NULL)
        return NULL;
    kvwc_entry_fn entry = (kvwc_entry_fn)dlsym(h, KVWC_ENTRY_NAME);
    const kvwc_ops_t *ops = entry ? entry() : NULL;
    if (ops == NULL) {
        snprintf(msg, cap, "the CUDA module has no entry point %s", KVWC_ENTRY_NAME);
        dlclose(h);
        return NULL;
    }
    if (ops->abi != KVWC_ABI_VERSION || ops->size != sizeof(kvwc_ops_t)) {
        snprintf(msg, cap,
                 "the CUDA module was built for ABI %u (table of %u bytes); this library "
                 "needs ABI %u (%zu bytes): rebuild or reinstall them together",
                 ops->abi, ops->size, KVWC_ABI_VERSION, sizeof(kvwc_ops_t));
        dlclose(h);
        return NULL;
    }
    return ops;
}

#endif
