/* The environment settings table and its parser; see config.h. */
#include "core/config.h"

#include "cuda/module.h" /* KVWC_EXEC_SLOTS */

#include <kvwire/xfer.h>

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define KVW_CFG_STR_(x) #x
#define KVW_CFG_STR(x) KVW_CFG_STR_(x)

/*
 * Every environment variable kvwire reads. Limits are where the code has a real bound
 * (16 worker threads, KVWC_EXEC_SLOTS kernel slots) or where a larger value can only be
 * a mistake (a busy-poll of more than a second). Keep the rows in the order `kvwire
 * info` should list them.
 */
static const char *kvw__verify_check(const char *text)
{
    int mode;
    uint32_t ppm;
    return kvw__verify_parse(text, &mode, &ppm);
}

const char *kvw__verify_parse(const char *text, int *mode_p, uint32_t *ppm_p)
{
    *mode_p = KVW_VERIFY_OFF;
    *ppm_p = 0;
    if (text == NULL || strcmp(text, "off") == 0)
        return NULL;
    if (strcmp(text, "every") == 0) {
        *mode_p = KVW_VERIFY_EVERY;
        *ppm_p = 1000000;
        return NULL;
    }
    if (strncmp(text, "sample:", 7) != 0)
        return "is not off, every or sample:F";
    const char *c = text + 7;
    uint64_t whole = 0, frac = 0, scale = 1000000;
    if (*c < '0' || *c > '9')
        return "needs a fraction after sample: (sample:0.1)";
    for (; *c >= '0' && *c <= '9'; c++)
        if ((whole = whole * 10 + (uint64_t)(*c - '0')) > 1)
            return "has a fraction above 1";
    if (*c == '.') {
        c++;
        if (*c < '0' || *c > '9')
            return "has no digits after the point";
        for (; *c >= '0' && *c <= '9'; c++) {
            if (scale == 1)
                return "has more than 6 digits after the point";
            scale /= 10;
            frac += (uint64_t)(*c - '0') * scale;
        }
    }
    if (*c != '\0')
        return "is not a decimal fraction";
    uint64_t ppm = whole * 1000000 + frac;
    if (ppm > 1000000)
        return "has a fraction above 1";
    *mode_p = KVW_VERIFY_SAMPLE;
    *ppm_p = (uint32_t)ppm;
    return NULL;
}

static const kvw_cfg_def_t kvw_cfg_table[] = {
    {.name = "KVW_WORKERS", .type = KVW_CFG_U64, .def = "4", .min = 1, .max = 16,
     .help = "prefill sender threads per context (decode ranks served in parallel)"},
    {.name = "KVW_GPU_INFLIGHT", .type = KVW_CFG_U64, .def = KVW_CFG_STR(KVWC_EXEC_SLOTS),
     .min = 1, .max = KVWC_EXEC_SLOTS,
     .help = "GPU copy kernels in flight per sender thread (1 waits for each)"},
    {.name = "KVW_GPU_BATCH", .type = KVW_CFG_U64, .def = "8", .min = 1, .max = 32,
     .help = "cuda_ipc: small rooms' copies (one chunk of at most 2048 tokens left) that a "
             "sender thread launches as one kernel (1: one kernel per room and decode rank)"},
    {.name = "KVW_GPU_WARM", .type = KVW_CFG_U64, .def = "1", .min = 0, .max = 1,
     .help = "prefill with GPU buffers: sender threads make their CUDA executors when the "
             "context starts (0: on their first room, which then pays for it)"},
    {.name = "KVW_STAGING_MB", .type = KVW_CFG_U64, .def = "64", .min = 0, .max = 1u << 20,
     .help = "decode staging area for gathered head slices, MiB per rank (0: none)"},
    {.name = "KVW_PATH", .type = KVW_CFG_CHOICE, .def = "auto", .choices = "auto|direct|staged",
     .help = "force the data path of every plan (auto: chosen per plan)"},
    {.name = "KVW_BUSY_POLL_US", .type = KVW_CFG_U64, .def = "0", .min = 0, .max = 1000000,
     .help = "spin this long for the next event before sleeping (latency)"},
    {.name = "KVW_VERIFY", .type = KVW_CFG_STRING, .def = "off",
     .help = "decode: end-to-end KV digest per room (off, every, sample:F with F in [0, 1]); "
             "a room verified and wrong fails, on both sides [off|every|sample:F]",
     .check = kvw__verify_check},
    {.name = "KVW_VERIFY_INLINE_KB", .type = KVW_CFG_U64, .def = "256", .min = 0,
     .max = 1u << 20,
     .help = "prefill: a verified room's last step of at most this many KiB is hashed "
             "first and its completion carries the digest; a larger one sends the digest "
             "after it (0: always after)"},
    {.name = "KVW_MAX_PEER_ROOMS", .type = KVW_CFG_U64, .def = "4096", .min = 1,
     .max = 1u << 24,
     .help = "prefill: rooms one decode rank may create by REQ or ABORT before the engine "
             "opens them (more are refused; they expire after the wait timeout)"},
    {.name = "KVW_MAX_HELLO_KB", .type = KVW_CFG_U64, .def = "4096", .min = 64, .max = 65536,
     .help = "prefill: largest registration frame read before it is authenticated, KiB"},
    {.name = "KVW_MAX_PEERS", .type = KVW_CFG_U64, .def = "1024", .min = 1, .max = 65536,
     .help = "live peers per context (more registrations are refused)"},
    {.name = "KVW_MAX_CONN_PER_SOURCE", .type = KVW_CFG_U64, .def = "256", .min = 1,
     .max = 65536,
     .help = "connections one source address may hold on a data listener (tcp); more "
             "are closed at once"},
    {.name = "KVW_DATA_HELLO_MS", .type = KVW_CFG_U64, .def = "10000", .min = 100,
     .max = 600000,
     .help = "a data connection (tcp) must say HELLO and send its first frame (BIND) "
             "within this many ms of its accept"},
    {.name = "KVW_BS_MAX_SOURCE_ENTRIES", .type = KVW_CFG_U64, .def = "1024", .min = 1,
     .max = 4096,
     .help = "bootstrap endpoint: entries registered from one source address (4096, the "
             "table's size: no bound of its own)"},
    {.name = "KVW_CUDA_MODULE", .type = KVW_CFG_STRING, .def = "",
     .shown = "libkvwire_cuda.so next to libkvwire",
     .help = "path of the CUDA module loaded at run time"},
    {.name = "KVW_TL_MODULE_DIR", .type = KVW_CFG_STRING, .def = "",
     .shown = "next to libkvwire, ../lib, loader path",
     .help = "the only directory searched for transport modules (libkvwire-ucx.so)"},
    {.name = "KVW_UCX_TIMEOUT_MS", .type = KVW_CFG_U64, .def = "10000", .min = 1,
     .max = UINT32_MAX, .help = "deadline of every UCX wait (flush, put, notify)"},
    {.name = "KVW_UCX_PUT", .type = KVW_CFG_CHOICE, .def = "am", .choices = "am|rma",
     .help = "am: writes as messages the receiver checks; rma: ucp_put, unchecked"},
    {.name = "KVW_UCX_ERR_MODE", .type = KVW_CFG_CHOICE, .def = "peer", .choices = "peer|none",
     .help = "peer: detect dead peers (UCX then uses tcp lanes); none"},
    {.name = "UCX_TLS", .type = KVW_CFG_EXTERNAL, .def = "", .shown = "(UCX default)",
     .help = "UCX transports to use; set tcp across network namespaces"},
};

const kvw_cfg_def_t *kvw__config_table(size_t *count_p)
{
    if (count_p)
        *count_p = KVW_ARRAY_SIZE(kvw_cfg_table);
    return kvw_cfg_table;
}

static const kvw_cfg_def_t *cfg_find(const char *name)
{
    for (size_t i = 0; name != NULL && i < KVW_ARRAY_SIZE(kvw_cfg_table); i++)
        if (strcmp(kvw_cfg_table[i].name, name) == 0)
            return &kvw_cfg_table[i];
    return NULL;
}

/* Whether `word` is one of d->choices. */
static bool cfg_is_choice(const kvw_cfg_def_t *d, const char *word)
{
    size_t n = strlen(word);
    for (const char *c = d->choices; *c;) {
        const char *bar = strchr(c, '|');
        size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && strncmp(c, word, n) == 0)
            return true;
        if (bar == NULL)
            break;
        c = bar + 1;
    }
    return false;
}

/* What the setting accepts, for messages and for kvwire info: "an integer from 1 to
 * 16", "one of auto|direct|staged". */
static void cfg_expect(const kvw_cfg_def_t *d, char *buf, size_t cap)
{
    if (d->type == KVW_CFG_U64)
        snprintf(buf, cap, "an integer from %llu to %llu", (unsigned long long)d->min,
                 (unsigned long long)d->max);
    else if (d->type == KVW_CFG_CHOICE)
        snprintf(buf, cap, "one of %s", d->choices);
    else
        snprintf(buf, cap, "any text");
}

/*
 * Parses `text` (not empty) as a value of d. For U64 *num_p gets the number. KVW_OK,
 * or INVALID_PARAM with a message naming the variable, the value and what is expected.
 */
static kvw_status_t cfg_parse(const kvw_cfg_def_t *d, const char *text, uint64_t *num_p)
{
    char expect[96];
    const char *why = NULL;
    if (d->type == KVW_CFG_U64) {
        uint64_t v = 0;
        const char *c = text;
        for (; *c >= '0' && *c <= '9'; c++) {
            if (!kvw__mul_u64(v, 10, &v) || !kvw__add_u64(v, (uint64_t)(*c - '0'), &v)) {
                why = "is too large";
                break;
            }
        }
        if (why == NULL && (*c != '\0' || c == text))
            why = "is not a decimal integer";
        else if (why == NULL && (v < d->min || v > d->max))
            why = "is out of range";
        if (why == NULL) {
            *num_p = v;
            return KVW_OK;
        }
    } else if (d->type == KVW_CFG_CHOICE) {
        if (cfg_is_choice(d, text))
            return KVW_OK;
        why = "is not a known value";
    } else if (d->type == KVW_CFG_STRING && d->check) {
        if ((why = d->check(text)) == NULL)
            return KVW_OK;
        return kvw__error(KVW_ERR_INVALID_PARAM, "environment variable %s='%.128s' %s",
                          d->name, text, why);
    } else {
        return KVW_OK;
    }
    cfg_expect(d, expect, sizeof(expect));
    return kvw__error(KVW_ERR_INVALID_PARAM,
                      "environment variable %s='%.128s' %s: expected %s", d->name, text, why,
                      expect);
}

/* The variable's text: the environment's when set and not empty, else NULL. */
static const char *cfg_env(const kvw_cfg_def_t *d)
{
    const char *v = getenv(d->name);
    return v != NULL && v[0] != '\0' ? v : NULL;
}

kvw_status_t kvw__config_check(void)
{
    for (size_t i = 0; i < KVW_ARRAY_SIZE(kvw_cfg_table); i++) {
        const kvw_cfg_def_t *d = &kvw_cfg_table[i];
        const char *v = d->type == KVW_CFG_EXTERNAL ? NULL : cfg_env(d);
        uint64_t num;
        kvw_status_t st;
        if (v != NULL && (st = cfg_parse(d, v, &num)) != KVW_OK)
            return st;
    }
    return KVW_OK;
}

kvw_status_t kvw__config_u64(const char *name, uint64_t *value_p)
{
    const kvw_cfg_def_t *d = cfg_find(name);
    *value_p = 0;
    if (d == NULL || d->type != KVW_CFG_U64)
        return kvw__error(KVW_ERR_INVALID_PARAM, "no integer setting named %s",
                          name ? name : "(null)");
    uint64_t def = 0;
    if (cfg_parse(d, d->def, &def) != KVW_OK) /* the unit test proves it cannot fail */
        return KVW_ERR_INVALID_PARAM;
    *value_p = def;
    const char *v = cfg_env(d);
    uint64_t num;
    kvw_status_t st = v != NULL ? cfg_parse(d, v, &num) : KVW_OK;
    if (v != NULL && st == KVW_OK)
        *value_p = num;
    return st;
}

kvw_status_t kvw__config_str(const char *name, const char **value_p)
{
    const kvw_cfg_def_t *d = cfg_find(name);
    *value_p = "";
    if (d == NULL || (d->type != KVW_CFG_CHOICE && d->type != KVW_CFG_STRING))
        return kvw__error(KVW_ERR_INVALID_PARAM, "no text setting named %s",
                          name ? name : "(null)");
    *value_p = d->def;
    const char *v = cfg_env(d);
    uint64_t unused;
    kvw_status_t st = v != NULL ? cfg_parse(d, v, &unused) : KVW_OK;
    if (v != NULL && st == KVW_OK)
        *value_p = v;
    return st;
}

/* ---------------------------------------------------------------- public list */

/* kvw_config_vars: the table as name, default and help, where help ends with what the
 * setting accepts ("[1..16]", "[auto|direct|staged]"). Made once; the strings live as
 * long as the process. */
static kvw_config_var_t cfg_public[KVW_ARRAY_SIZE(kvw_cfg_table)];
static char cfg_public_help[KVW_ARRAY_SIZE(kvw_cfg_table)][256];
static pthread_once_t cfg_public_once = PTHREAD_ONCE_INIT;

static void cfg_public_fill(void)
{
    for (size_t i = 0; i < KVW_ARRAY_SIZE(kvw_cfg_table); i++) {
        const kvw_cfg_def_t *d = &kvw_cfg_table[i];
        if (d->type == KVW_CFG_U64)
            snprintf(cfg_public_help[i], sizeof(cfg_public_help[i]), "%s [%llu..%llu]", d->help,
                     (unsigned long long)d->min, (unsigned long long)d->max);
        else if (d->type == KVW_CFG_CHOICE)
            snprintf(cfg_public_help[i], sizeof(cfg_public_help[i]), "%s [%s]", d->help,
                     d->choices);
        else
            snprintf(cfg_public_help[i], sizeof(cfg_public_help[i]), "%s", d->help);
        cfg_public[i] = (kvw_config_var_t){.field_mask = KVW_CONFIG_VAR_FIELDS_ALL,
                                           .name = d->name,
                                           .default_value = d->shown ? d->shown : d->def,
                                           .help = cfg_public_help[i]};
    }
}

const kvw_config_var_t *kvw_config_vars(size_t *count_p)
{
    pthread_once(&cfg_public_once, cfg_public_fill);
    if (count_p)
        *count_p = KVW_ARRAY_SIZE(kvw_cfg_table);
    return cfg_public;
}
