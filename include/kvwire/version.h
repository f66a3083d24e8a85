/*
 * The version of kvwire: the one place it is written. CMake reads these three numbers
 * for project(VERSION), the shared library's file name and SONAME, kvwire.pc and the
 * CMake package; kvw_version() returns the string the library was built with, so a
 * program can compare it with the header it was compiled against.
 *
 * 0.x releases may change the API and ABI in a minor step.
 */
#ifndef KVWIRE_VERSION_H
#define KVWIRE_VERSION_H

#define KVW_VERSION_MAJOR 0
#define KVW_VERSION_MINOR 2
#define KVW_VERSION_PATCH 0

/* One number that orders versions: MAJOR * 10000 + MINOR * 100 + PATCH. */
#define KVW_VERSION_NUMBER                                                               \
    (KVW_VERSION_MAJOR * 10000 + KVW_VERSION_MINOR * 100 + KVW_VERSION_PATCH)

/* "MAJOR.MINOR.PATCH", spelled from the numbers above so that the two cannot differ. */
#define KVW_VERSION_STR_(x) #x
#define KVW_VERSION_STR(x) KVW_VERSION_STR_(x)
#define KVW_VERSION_STRING                                                               \
    KVW_VERSION_STR(KVW_VERSION_MAJOR) "." KVW_VERSION_STR(KVW_VERSION_MINOR) "."        \
        KVW_VERSION_STR(KVW_VERSION_PATCH)

#endif
