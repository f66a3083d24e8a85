/*
 * One version everywhere: the header's macros, kvw_version() and kvw_version_number()
 * of the library linked in, the same two of the shared library the build made
 * (libkvwire.so, loaded from $KVW_BUILD_DIR), and the project version CMake read from
 * the header (passed in as KVW_PROJECT_VERSION). A stale build, a hand-edited string or
 * a CMake that parsed the header wrongly each fail here.
 *
 * Exit status: 0 when every check passed, 1 otherwise.
 */
#include "check.h"

#include <kvwire/kvwire.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KVW_PROJECT_VERSION
#error "build with -DKVW_PROJECT_VERSION=\"x.y.z\" (CMake's PROJECT_VERSION)"
#endif

/* Checks one library's pair of version functions against the header. */
static void check_library(const char *which, const char *(*version)(void),
                          uint32_t (*number)(void))
{
    const char *v = version();
    CHECK(v != NULL && strcmp(v, KVW_VERSION_STRING) == 0, "%s kvw_version() is '%s', headers %s",
          which, v ? v : "(null)", KVW_VERSION_STRING);
    unsigned a = 99, b = 99, c = 99;
    char tail = 0;
    CHECK(v != NULL && sscanf(v, "%u.%u.%u%c", &a, &b, &c, &tail) == 3,
          "%s kvw_version() '%s' is not MAJOR.MINOR.PATCH", which, v ? v : "(null)");
    CHECK(a == KVW_VERSION_MAJOR && b == KVW_VERSION_MINOR && c == KVW_VERSION_PATCH,
          "%s kvw_version() %u.%u.%u, macros %d.%d.%d", which, a, b, c, KVW_VERSION_MAJOR,
          KVW_VERSION_MINOR, KVW_VERSION_PATCH);
    CHECK(number() == a * 10000u + b * 100u + c, "%s kvw_version_number() %u for '%s'", which,
          (unsigned)number(), v ? v : "(null)");
}

int main(void)
{
    /* The header against CMake's project version. */
    CHECK(strcmp(KVW_VERSION_STRING, KVW_PROJECT_VERSION) == 0,
          "header says %s, CMake's project version is %s", KVW_VERSION_STRING,
          KVW_PROJECT_VERSION);
    CHECK(KVW_VERSION_NUMBER ==
              KVW_VERSION_MAJOR * 10000 + KVW_VERSION_MINOR * 100 + KVW_VERSION_PATCH,
          "KVW_VERSION_NUMBER %d", KVW_VERSION_NUMBER);
    check_library("linked", kvw_version, kvw_version_number);

    /* The shared library, as a consumer of the installed package gets it. */
    const char *dir = getenv("KVW_BUILD_DIR");
    if (dir == NULL) {
        printf("test_version: KVW_BUILD_DIR not set, shared library not checked\n");
    } else {
        char path[4096];
        snprintf(path, sizeof(path), "%s/libkvwire.so", dir);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        CHECK(h != NULL, "cannot load %s: %s", path, dlerror());
        if (h != NULL) {
            const char *(*ver)(void) = (const char *(*)(void))dlsym(h, "kvw_version");
            uint32_t (*num)(void) = (uint32_t(*)(void))dlsym(h, "kvw_version_number");
            CHECK(ver != NULL && num != NULL, "%s lacks kvw_version or kvw_version_number", path);
            if (ver != NULL && num != NULL)
                check_library("libkvwire.so", ver, num);
            dlclose(h);
        }
    }

    if (failures) {
        fprintf(stderr, "test_version: %d of %d checks FAILED\n", failures, checks);
        return 1;
    }
    printf("test_version: all %d checks passed (%s)\n", checks, kvw_version());
    return 0;
}
