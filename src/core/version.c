/* The library's version, compiled in from kvwire/version.h. */
#include "core/core.h"

const char *kvw_version(void)
{
    return KVW_VERSION_STRING;
}

uint32_t kvw_version_number(void)
{
    return KVW_VERSION_NUMBER;
}
