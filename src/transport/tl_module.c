/* Loading transport modules (libkvwire-NAME.so); see tl_module.h. */
#include "transport/tl_module.h"

#include "core/config.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef KVW_TL_MODULE_BIN_TO_LIB
#define KVW_TL_MODULE_BIN_TO_LIB "../lib"
#endif

static const kvw_tl_host_t tl_module_host = {
    .abi = KVW_TL_MODULE_ABI,
    .ops_size = sizeof(kvw_tl_ops_t),
    .version = KVW_VERSION_STRING,
    .verror = kvw__verror,
    .now_ns = kvw__now_ns,
    .status_string = kvw_status_string,
};

/* One module today (ucx); a slot per name keeps the result of the first attempt, so a
 * missing module costs one search per process and its message stays the same. */
typedef struct tl_module {
    const char *name;
    bool tried;
    const kvw_tl_ops_t *ops;
    char msg[768];
} tl_module_t;

static tl_module_t tl_modules[] = {
    {.name = "ucx"},
};

/* Appends "; what" to the slot's message, which lists every place tried. */
static void tl_module_note(tl_module_t *m, const char *what)
{
    size_t used = strlen(m->msg);
    if (used + 1 < sizeof(m->msg))
        snprintf(m->msg + used, sizeof(m->msg) - used, "%s%s", used ? "; " : "", what);
}

/* Tries one path or file name: true when the module loaded and accepted this library. */
static bool tl_module_try(tl_module_t *m, const char *path)
{
    char note[512];
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        snprintf(note, sizeof(note), "%s", dlerror());
        tl_module_note(m, note);
        return false;
    }
    kvw_tl_module_entry_fn entry = (kvw_tl_module_entry_fn)dlsym(h, KVW_TL_MODULE_ENTRY);
    const kvw_tl_ops_t *ops = entry ? entry(&tl_module_host) : NULL;
    if (ops == NULL) {
        snprintf(note, sizeof(note), "%s: %s", path,
                 entry ? "built for another kvwire (ABI, table size or version)"
                       : "no entry point " KVW_TL_MODULE_ENTRY);
        tl_module_note(m, note);
        dlclose(h);
        return false;
    }
    /* Never closed: the transport's threads and tables live as long as the process. */
    m->ops = ops;
    return true;
}

/* Tries DIR/FILE. */
static bool tl_module_try_dir(tl_module_t *m, const char *dir, size_t dir_len, const char *file)
{
    char path[4096];
    int n = snprintf(path, sizeof(path), "%.*s/%s", (int)dir_len, dir, file);
    return n > 0 && (size_t)n < sizeof(path) && tl_module_try(m, path);
}

static void tl_module_load(tl_module_t *m)
{
    char file[128];
    snprintf(file, sizeof(file), "libkvwire-%s.so", m->name);
    const char *env; /* any text; "" when unset */
    kvw__config_str("KVW_TL_MODULE_DIR", &env);
    if (*env != '\0') {
        tl_module_try_dir(m, env, strlen(env), file);
        return;
    }
    /* Next to the object that holds this code: libkvwire.so, or a program linked with
     * the static library in the build tree. */
    Dl_info info;
    char self[4096];
    if (dladdr((void *)tl_module_load, &info) && info.dli_fname) {
        /* The main program's name comes back without a directory: a static libkvwire
         * linked into a program (kvwire-bench) looks beside that program's file. */
        if (strchr(info.dli_fname, '/') == NULL) {
            ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
            self[n > 0 ? n : 0] = '\0';
            info.dli_fname = self;
        }
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash != NULL) {
            size_t len = (size_t)(slash - info.dli_fname);
            if (tl_module_try_dir(m, info.dli_fname, len, file))
                return;
            /* A program installed in bin/ next to lib/ (the CLI). */
            char dir[4096];
            int n = snprintf(dir, sizeof(dir), "%.*s/%s", (int)len, info.dli_fname,
                             KVW_TL_MODULE_BIN_TO_LIB);
            if (n > 0 && (size_t)n < sizeof(dir) && tl_module_try_dir(m, dir, (size_t)n, file))
                return;
        }
    }
    tl_module_try(m, file);
}

const kvw_tl_ops_t *kvw__tl_module_load(const char *name)
{
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    for (size_t i = 0; i < KVW_ARRAY_SIZE(tl_modules); i++) {
        tl_module_t *m = &tl_modules[i];
        if (strcmp(m->name, name) != 0)
            continue;
        pthread_mutex_lock(&mu);
        if (!m->tried) {
            m->tried = true;
            tl_module_load(m);
        }
        pthread_mutex_unlock(&mu);
        if (m->ops == NULL)
            kvw__error(KVW_ERR_NOT_FOUND, "transport module libkvwire-%s.so not loaded: %s", name,
                       m->msg);
        return m->ops;
    }
    kvw__error(KVW_ERR_NOT_FOUND, "no transport module named '%s'", name);
    return NULL;
}
