/*
 * Transport tables are checked where they are found (src/transport/registry.c): a table
 * that leaves a required slot empty is refused by kvw__tl_find with a message naming
 * the transport and the slot; a whole table (the built-in tcp one, returned by the same
 * resolver) is found as before, and so is the mended one. The ucx module (where this
 * build has one) hands its table only to a host of its own ABI, table size and version
 * (src/transport/tl_module.h): a host that differs in any one of them gets NULL.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "inproc.h"

#include "transport/tl_module.h"
#include "transport/transport.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const kvw_tl_ops_t kvw_tl_tcp_ops;

static kvw_tl_ops_t broken; /* tcp's table without its put */

static const kvw_tl_ops_t *slots_find(const char *name)
{
    if (strcmp(name, "slots:whole") == 0)
        return &kvw_tl_tcp_ops;
    return &broken;
}

static const kvw_tl_resolver_t slots_resolver = {.prefix = "slots:", .find = slots_find};

/* The module's entry point against hosts that differ from the library in one field. */
static void module_abi(void)
{
    const char *dir = getenv("KVW_BUILD_DIR");
    char path[4096];
    snprintf(path, sizeof(path), "%s/libkvwire-ucx.so", dir ? dir : ".");
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) { /* a build without UCX (or its libraries): nothing to check */
        fprintf(stderr, "  ucx module not loaded (%s): ABI check skipped\n", dlerror());
        return;
    }
    kvw_tl_module_entry_fn entry = (kvw_tl_module_entry_fn)dlsym(h, KVW_TL_MODULE_ENTRY);
    CHECK(entry != NULL, "%s has no %s", path, KVW_TL_MODULE_ENTRY);
    if (entry == NULL)
        return;
    static const kvw_tl_host_t good = {.abi = KVW_TL_MODULE_ABI,
                                       .ops_size = sizeof(kvw_tl_ops_t),
                                       .version = KVW_VERSION_STRING,
                                       .verror = kvw__verror,
                                       .now_ns = kvw__now_ns,
                                       .status_string = kvw_status_string};
    kvw_tl_host_t bad = good;
    bad.abi = KVW_TL_MODULE_ABI - 1;
    CHECK(entry(&bad) == NULL, "a host of ABI %u got a table", bad.abi);
    bad = good;
    bad.ops_size = (uint32_t)sizeof(kvw_tl_ops_t) - (uint32_t)sizeof(void *);
    CHECK(entry(&bad) == NULL, "a host whose table is %u bytes got one", bad.ops_size);
    bad = good;
    bad.version = "0.0.0-other";
    CHECK(entry(&bad) == NULL, "a host of version %s got a table", bad.version);
    CHECK(entry(NULL) == NULL, "no host, and a table");
    const kvw_tl_ops_t *ops = entry(&good);
    CHECK(ops != NULL && ops->name != NULL && strcmp(ops->name, "ucx") == 0 &&
              ops->init != NULL && ops->stop != NULL && ops->fini != NULL &&
              !(ops->caps & KVW_TL_CAP_MEDIATED),
          "the matching host: table %p (%s)", (const void *)ops, ops && ops->name ? ops->name : "");
    /* Left loaded, as the library's own loader leaves it: unloading would orphan what
     * the UCX libraries' constructors allocated (LeakSanitizer reports it). */
}

int main(void)
{
    broken = kvw_tl_tcp_ops;
    broken.name = "slots:noput";
    broken.put = NULL;
    kvw__tl_set_resolver(&slots_resolver);

    CHECK(kvw__tl_find("slots:whole") == &kvw_tl_tcp_ops, "a whole table was refused: %s",
          kvw_last_error());
    CHECK(kvw__tl_find("slots:noput") == NULL, "a table without put was accepted");
    CHECK(kvt_contains(kvw_last_error(), "transport 'slots:noput' leaves its required slot "
                                         "'put' empty"),
          "message: %s", kvw_last_error());
    broken.put = kvw_tl_tcp_ops.put;
    broken.fini = NULL;
    CHECK(kvw__tl_find("slots:noput") == NULL &&
              kvt_contains(kvw_last_error(), "required slot 'fini' empty"),
          "a table without fini: %s", kvw_last_error());
    broken.fini = kvw_tl_tcp_ops.fini;
    CHECK(kvw__tl_find("slots:noput") == &broken, "the mended table was refused: %s",
          kvw_last_error());
    /* rkey_ptr is optional: tcp has none. */
    CHECK(kvw_tl_tcp_ops.rkey_ptr == NULL && kvw__tl_find("tcp") == &kvw_tl_tcp_ops,
          "tcp itself: %s", kvw_last_error());
    kvw__tl_set_resolver(NULL);
    module_abi();
    return ip_summary("test_tl_slots");
}
