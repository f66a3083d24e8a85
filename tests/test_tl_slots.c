/*
 * Transport tables are checked where they are found (src/transport/registry.c): a table
 * that leaves a required slot empty is refused by kvw__tl_find with a message naming
 * the transport and the slot; a whole table (the built-in tcp one, returned by the same
 * resolver) is found as before, and so is the mended one.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "inproc.h"

#include "transport/transport.h"

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
    return ip_summary("test_tl_slots");
}
