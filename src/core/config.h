/*
 * Settings read from the environment, in one table (config.c): for each variable its
 * name, type, default, allowed values and meaning. The public kvw_config_vars(), which
 * `kvwire info` prints, is made from the same table, so the list cannot drift from
 * what the code reads.
 *
 * Every context checks the whole environment once, when it is created
 * (kvw__config_check): a value that does not parse or is out of range fails the
 * creation with KVW_ERR_INVALID_PARAM and a message naming the variable and the value.
 * Code then reads a setting through a getter, by name, which parses the same way and
 * returns the default when the variable is unset or empty.
 *
 * The UCX transport (a module, linked without the core) still parses its KVW_UCX_*
 * variables itself; they are in the table so that they are listed and checked.
 */
#ifndef KVW_CORE_CONFIG_H
#define KVW_CORE_CONFIG_H

#include "core/core.h"

#include <stddef.h>
#include <stdint.h>

typedef enum kvw_cfg_type {
    KVW_CFG_U64,      /* a decimal integer within [min, max] */
    KVW_CFG_CHOICE,   /* one word of `choices` ("auto|direct|staged") */
    KVW_CFG_STRING,   /* any text (a path) */
    KVW_CFG_EXTERNAL, /* read by another library (UCX); listed, never parsed here */
} kvw_cfg_type_t;

typedef struct kvw_cfg_def {
    const char *name;
    kvw_cfg_type_t type;
    const char *def;     /* the default, written as a value would be ("" = none) */
    uint64_t min, max;   /* KVW_CFG_U64 */
    const char *choices; /* KVW_CFG_CHOICE: the allowed words, separated by '|' */
    const char *shown;   /* the default in words for `kvwire info`; NULL: def */
    const char *help;
    /* KVW_CFG_STRING: optional check of the text (KVW_OK, or INVALID_PARAM with the
     * reason, which cfg_parse prefixes with the variable's name and value). */
    const char *(*check)(const char *text);
} kvw_cfg_def_t;

/* The table; *count_p gets its length. */
const kvw_cfg_def_t *kvw__config_table(size_t *count_p);

/* Parses every variable of the table that is set. KVW_OK, or KVW_ERR_INVALID_PARAM
 * with a message naming the first bad variable and its value. */
kvw_status_t kvw__config_check(void);

/*
 * The value of a KVW_CFG_U64 / KVW_CFG_CHOICE or KVW_CFG_STRING setting: the
 * environment's when set and not empty, else the table's default. A value that does
 * not parse or is out of range gives KVW_ERR_INVALID_PARAM with a message, and the
 * default in *value_p all the same, so that code running after kvw__config_check (the
 * environment may not change under a running call: setenv racing getenv is undefined)
 * may ignore the status. A name not in the table, or of another type, is
 * KVW_ERR_INVALID_PARAM with 0 / "".
 */
kvw_status_t kvw__config_u64(const char *name, uint64_t *value_p);
kvw_status_t kvw__config_str(const char *name, const char **value_p);

/*
 * KV verification modes (KVW_VERIFY, kvw_ctx_params_t.verify): "off", "every" (every
 * room) or "sample:F" with F a fraction in [0, 1] written as a decimal ("sample:0.1",
 * "sample:1", at most 6 digits after the point). Parsed into a mode and, for sampling,
 * parts per million. NULL: the text is fine; else why not (static text).
 */
#define KVW_VERIFY_OFF 0
#define KVW_VERIFY_EVERY 1
#define KVW_VERIFY_SAMPLE 2
const char *kvw__verify_parse(const char *text, int *mode_p, uint32_t *ppm_p);

#endif
