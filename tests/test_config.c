/*
 * The environment settings table (src/core/config.c):
 *   table      every row is well formed: a unique name, a default that parses and lies
 *              within its own range, choices for a choice; kvw_config_vars (what
 *              `kvwire info` prints) lists the same rows, defaults and ranges
 *   defaults   with nothing set, each getter gives the table's default; an empty
 *              variable counts as unset
 *   accepted   values at both ends of each range, and every choice
 *   refused    values that do not parse or are out of range: kvw__config_check and the
 *              getter return INVALID_PARAM, with a message that names the variable and
 *              the value, and the getter still hands back the default
 *   context    kvw_ctx_create refuses a bad value with INVALID_PARAM and that message,
 *              and succeeds once it is fixed
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include "core/config.h"

#include <inttypes.h>

/* Every variable of the table unset, so that each case starts from the defaults. */
static void unset_all(void)
{
    size_t n;
    const kvw_cfg_def_t *t = kvw__config_table(&n);
    for (size_t i = 0; i < n; i++)
        unsetenv(t[i].name);
}

static void check_table(void)
{
    size_t n, np;
    const kvw_cfg_def_t *t = kvw__config_table(&n);
    const kvw_config_var_t *pub = kvw_config_vars(&np);
    CHECK(n >= 10 && np == n, "table of %zu rows, public list of %zu", n, np);
    for (size_t i = 0; i < n && i < np; i++) {
        const kvw_cfg_def_t *d = &t[i];
        CHECK(d->name && d->help && d->help[0] && d->def, "row %zu incomplete", i);
        CHECK(strncmp(d->name, "KVW_", 4) == 0 || d->type == KVW_CFG_EXTERNAL,
              "%s: only KVW_ variables are parsed here", d->name);
        for (size_t j = 0; j < i; j++)
            CHECK(strcmp(t[j].name, d->name) != 0, "%s listed twice", d->name);
        if (d->type == KVW_CFG_U64) {
            char *end;
            unsigned long long v = strtoull(d->def, &end, 10);
            CHECK(*end == '\0' && d->min <= d->max && v >= d->min && v <= d->max,
                  "%s: default '%s' outside %" PRIu64 "..%" PRIu64, d->name, d->def, d->min,
                  d->max);
        }
        if (d->type == KVW_CFG_CHOICE) {
            size_t dl = strlen(d->def);
            const char *c = d->choices ? strstr(d->choices, d->def) : NULL;
            CHECK(c && (c == d->choices || c[-1] == '|') && (c[dl] == '\0' || c[dl] == '|'),
                  "%s: default '%s' is not one of '%s'", d->name, d->def,
                  d->choices ? d->choices : "(none)");
        }
        /* The public row: same name, the default as shown, and the range in the help. */
        CHECK(!strcmp(pub[i].name, d->name), "public row %zu is %s, table row %s", i,
              pub[i].name, d->name);
        CHECK(!strcmp(pub[i].default_value, d->shown ? d->shown : d->def),
              "%s: public default '%s'", d->name, pub[i].default_value);
        char range[64] = "";
        if (d->type == KVW_CFG_U64)
            snprintf(range, sizeof(range), "[%" PRIu64 "..%" PRIu64 "]", d->min, d->max);
        else if (d->type == KVW_CFG_CHOICE)
            snprintf(range, sizeof(range), "[%s]", d->choices);
        CHECK(strstr(pub[i].help, d->help) && strstr(pub[i].help, range),
              "%s: public help '%s' lacks '%s'", d->name, pub[i].help, range);
    }
    /* Every variable the library reads is in the table (the UCX ones are parsed by the
     * module but listed and checked here). */
    static const char *const read[] = {
        "KVW_WORKERS",     "KVW_GPU_INFLIGHT",  "KVW_GPU_BATCH",      "KVW_STAGING_MB",
        "KVW_PATH",
        "KVW_BUSY_POLL_US", "KVW_CUDA_MODULE",  "KVW_TL_MODULE_DIR", "KVW_UCX_TIMEOUT_MS",
        "KVW_UCX_PUT",     "KVW_UCX_ERR_MODE",  "KVW_MAX_PEER_ROOMS", "KVW_MAX_HELLO_KB",
        "KVW_MAX_PEERS",   "KVW_MAX_CONN_PER_SOURCE", "KVW_DATA_HELLO_MS",
        "KVW_BS_MAX_SOURCE_ENTRIES", "KVW_VERIFY",
    };
    for (size_t k = 0; k < KVW_ARRAY_SIZE(read); k++) {
        bool found = false;
        for (size_t i = 0; i < n; i++)
            found |= !strcmp(t[i].name, read[k]);
        CHECK(found, "%s is not in the table", read[k]);
    }
}

static void check_u64(const char *name, uint64_t want)
{
    uint64_t v = 12345;
    CHECK(kvw__config_u64(name, &v) == KVW_OK && v == want, "%s: %" PRIu64 " (want %" PRIu64
          "): %s", name, v, want, kvw_last_error());
}

static void check_str(const char *name, const char *want)
{
    const char *v = NULL;
    CHECK(kvw__config_str(name, &v) == KVW_OK && v && !strcmp(v, want),
          "%s: '%s' (want '%s'): %s", name, v ? v : "(null)", want, kvw_last_error());
}

static void check_defaults(void)
{
    unset_all();
    CHECK(kvw__config_check() == KVW_OK, "nothing set: %s", kvw_last_error());
    check_u64("KVW_WORKERS", 4);
    check_u64("KVW_GPU_INFLIGHT", 8);
    check_u64("KVW_GPU_BATCH", 8);
    check_u64("KVW_STAGING_MB", 64);
    check_u64("KVW_BUSY_POLL_US", 0);
    check_u64("KVW_UCX_TIMEOUT_MS", 10000);
    check_str("KVW_PATH", "auto");
    check_str("KVW_UCX_PUT", "am");
    check_str("KVW_UCX_ERR_MODE", "peer");
    check_str("KVW_CUDA_MODULE", "");
    check_str("KVW_TL_MODULE_DIR", "");
    /* Empty is unset. */
    setenv("KVW_WORKERS", "", 1);
    setenv("KVW_PATH", "", 1);
    CHECK(kvw__config_check() == KVW_OK, "empty values: %s", kvw_last_error());
    check_u64("KVW_WORKERS", 4);
    check_str("KVW_PATH", "auto");
    /* Names that are not settings of that type. */
    uint64_t v = 1;
    const char *s = NULL;
    CHECK(kvw__config_u64("KVW_NO_SUCH", &v) == KVW_ERR_INVALID_PARAM && v == 0,
          "unknown name accepted");
    CHECK(kvw__config_u64("KVW_PATH", &v) == KVW_ERR_INVALID_PARAM, "KVW_PATH read as number");
    CHECK(kvw__config_str("KVW_WORKERS", &s) == KVW_ERR_INVALID_PARAM && s && !s[0],
          "KVW_WORKERS read as text");
    CHECK(kvw__config_str("UCX_TLS", &s) == KVW_ERR_INVALID_PARAM, "UCX_TLS parsed here");
    unset_all();
}

static void check_accepted(void)
{
    static const struct {
        const char *name, *value;
        uint64_t num; /* for integers */
    } ok[] = {
        {"KVW_WORKERS", "1", 1},
        {"KVW_WORKERS", "16", 16},
        {"KVW_WORKERS", "007", 7},
        {"KVW_GPU_INFLIGHT", "1", 1},
        {"KVW_GPU_INFLIGHT", "8", 8},
        {"KVW_GPU_BATCH", "1", 1},
        {"KVW_GPU_BATCH", "32", 32},
        {"KVW_STAGING_MB", "0", 0},
        {"KVW_STAGING_MB", "1048576", 1048576},
        {"KVW_BUSY_POLL_US", "1000000", 1000000},
        {"KVW_UCX_TIMEOUT_MS", "1", 1},
        {"KVW_UCX_TIMEOUT_MS", "4294967295", 4294967295u},
        {"KVW_PATH", "auto", 0},
        {"KVW_PATH", "direct", 0},
        {"KVW_PATH", "staged", 0},
        {"KVW_UCX_PUT", "rma", 0},
        {"KVW_UCX_ERR_MODE", "none", 0},
        {"KVW_CUDA_MODULE", "/x/libkvwire_cuda.so", 0},
        {"KVW_TL_MODULE_DIR", "/opt/kvwire/lib", 0},
        {"UCX_TLS", "not,checked,here", 0},
        {"KVW_VERIFY", "off", 0},
        {"KVW_VERIFY", "every", 0},
        {"KVW_VERIFY", "sample:0.1", 0},
        {"KVW_VERIFY", "sample:0", 0},
        {"KVW_VERIFY", "sample:1", 0},
        {"KVW_VERIFY", "sample:1.000000", 0},
    };
    for (size_t i = 0; i < KVW_ARRAY_SIZE(ok); i++) {
        unset_all();
        setenv(ok[i].name, ok[i].value, 1);
        CHECK(kvw__config_check() == KVW_OK, "%s=%s refused: %s", ok[i].name, ok[i].value,
              kvw_last_error());
        uint64_t v;
        const char *s;
        if (kvw__config_u64(ok[i].name, &v) != KVW_ERR_INVALID_PARAM)
            check_u64(ok[i].name, ok[i].num);
        else if (kvw__config_str(ok[i].name, &s) != KVW_ERR_INVALID_PARAM)
            check_str(ok[i].name, ok[i].value);
    }
    unsetenv("UCX_TLS");
    unset_all();
}

/* The refused values: each must fail the check and the getter, name the variable and
 * the value, and leave the getter's output at the default. */
static const struct {
    const char *name, *value, *why;
} bad[] = {
    {"KVW_WORKERS", "abc", "not a decimal integer"},
    {"KVW_WORKERS", "0", "out of range"},
    {"KVW_WORKERS", "17", "out of range"},
    {"KVW_WORKERS", "-1", "not a decimal integer"},
    {"KVW_WORKERS", " 4", "not a decimal integer"},
    {"KVW_WORKERS", "4x", "not a decimal integer"},
    {"KVW_WORKERS", "+4", "not a decimal integer"},
    {"KVW_WORKERS", "0x4", "not a decimal integer"},
    {"KVW_WORKERS", "99999999999999999999999", "too large"},
    {"KVW_GPU_INFLIGHT", "9", "out of range"},
    {"KVW_GPU_INFLIGHT", "0", "out of range"},
    {"KVW_GPU_BATCH", "33", "out of range"},
    {"KVW_GPU_BATCH", "0", "out of range"},
    {"KVW_STAGING_MB", "abc", "not a decimal integer"},
    {"KVW_STAGING_MB", "1048577", "out of range"},
    {"KVW_STAGING_MB", "64M", "not a decimal integer"},
    {"KVW_BUSY_POLL_US", "1000001", "out of range"},
    {"KVW_UCX_TIMEOUT_MS", "0", "out of range"},
    {"KVW_UCX_TIMEOUT_MS", "4294967296", "out of range"},
    {"KVW_PATH", "fast", "not a known value"},
    {"KVW_VERIFY", "on", "is not off, every or sample:F"},
    {"KVW_VERIFY", "Every", "is not off, every or sample:F"},
    {"KVW_VERIFY", "sample", "is not off, every or sample:F"},
    {"KVW_VERIFY", "sample:", "needs a fraction"},
    {"KVW_VERIFY", "sample:1.5", "above 1"},
    {"KVW_VERIFY", "sample:2", "above 1"},
    {"KVW_VERIFY", "sample:0.", "no digits after the point"},
    {"KVW_VERIFY", "sample:0.1234567", "more than 6 digits"},
    {"KVW_VERIFY", "sample:0.1x", "not a decimal fraction"},
    {"KVW_VERIFY", "sample:-0.1", "needs a fraction"},
    {"KVW_PATH", "Direct", "not a known value"},
    {"KVW_PATH", "direct ", "not a known value"},
    {"KVW_PATH", "auto|direct", "not a known value"},
    {"KVW_PATH", "dir", "not a known value"},
    {"KVW_UCX_PUT", "put", "not a known value"},
    {"KVW_UCX_ERR_MODE", "off", "not a known value"},
};

static void check_refused(void)
{
    for (size_t i = 0; i < KVW_ARRAY_SIZE(bad); i++) {
        unset_all();
        setenv(bad[i].name, bad[i].value, 1);
        char want[160];
        snprintf(want, sizeof(want), "%s='%s'", bad[i].name, bad[i].value);
        kvw__clear_error();
        CHECK(kvw__config_check() == KVW_ERR_INVALID_PARAM, "%s accepted", want);
        const char *msg = kvw_last_error();
        CHECK(strstr(msg, want) && strstr(msg, bad[i].why), "%s: message '%s' (want '%s')",
              want, msg, bad[i].why);
        uint64_t v = 0, def = 0;
        const char *s = NULL;
        size_t n;
        const kvw_cfg_def_t *t = kvw__config_table(&n);
        for (size_t k = 0; k < n; k++)
            if (!strcmp(t[k].name, bad[i].name))
                def = strtoull(t[k].def, NULL, 10);
        kvw__clear_error();
        if (kvw__config_u64(bad[i].name, &v) == KVW_ERR_INVALID_PARAM &&
            strstr(kvw_last_error(), want))
            CHECK(v == def, "%s: getter gave %" PRIu64 ", not the default %" PRIu64, want, v, def);
        else if (kvw__config_str(bad[i].name, &s) == KVW_ERR_INVALID_PARAM)
            CHECK(strstr(kvw_last_error(), want) && s && strcmp(s, bad[i].value) != 0,
                  "%s: getter gave '%s': %s", want, s ? s : "(null)", kvw_last_error());
        else
            CHECK(0, "%s: the getter accepted it", want);
    }
    unset_all();
}

/* A context is refused while a variable is bad, and created once it is fixed. */
static void check_context(void)
{
    kvt_model_t model;
    if (ip_model("test_config", &model))
        return;
    kvt_rank_t r = {0};
    CHECK(ip_rank(&model, 1, 0, 4, 1, &r) == KVW_OK, "%s", kvw_last_error());
    kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, &r, "tcp", NULL, false);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    static const char *const cases[][2] = {
        {"KVW_STAGING_MB", "abc"}, /* once silently no staging at all */
        {"KVW_WORKERS", "many"},
        {"KVW_PATH", "fastest"},
        {"KVW_GPU_INFLIGHT", "100"}, /* read by worker threads, checked at creation */
        {"KVW_UCX_PUT", "rdma"},     /* parsed by the ucx module, checked for every context */
        {"KVW_VERIFY", "sample:3"},
    };
    for (size_t i = 0; i < KVW_ARRAY_SIZE(cases); i++) {
        unset_all();
        setenv(cases[i][0], cases[i][1], 1);
        kvw_ctx_h ctx = NULL;
        char want[128];
        snprintf(want, sizeof(want), "%s='%s'", cases[i][0], cases[i][1]);
        kvw_status_t st = kvw_ctx_create(&p, &ctx);
        CHECK(st == KVW_ERR_INVALID_PARAM && ctx == NULL && strstr(kvw_last_error(), want),
              "%s: context creation gave %s: %s", want, kvw_status_string(st), kvw_last_error());
        if (ctx)
            kvw_ctx_destroy(ctx);
    }
    /* The parameter is checked as the variable is, and named. */
    unset_all();
    kvw_ctx_params_t pv = p;
    pv.field_mask |= KVW_CTX_FIELD_VERIFY;
    pv.verify = "sometimes";
    kvw_ctx_h vctx = NULL;
    kvw_status_t vst = kvw_ctx_create(&pv, &vctx);
    CHECK(vst == KVW_ERR_INVALID_PARAM && vctx == NULL &&
              strstr(kvw_last_error(), "verify 'sometimes' is not off, every or sample:F"),
          "verify parameter: %s: %s", kvw_status_string(vst), kvw_last_error());
    if (vctx)
        kvw_ctx_destroy(vctx);
    unset_all();
    setenv("KVW_STAGING_MB", "1", 1);
    kvw_ctx_h ctx = NULL;
    CHECK(kvw_ctx_create(&p, &ctx) == KVW_OK, "valid settings: %s", kvw_last_error());
    if (ctx)
        kvw_ctx_destroy(ctx);
    unset_all();
    kvt_rank_free(&r);
}

/* KVW_VERIFY's values as the library reads them: mode and rooms per million. */
static void check_verify_parse(void)
{
    static const struct {
        const char *text;
        int mode;
        uint32_t ppm;
    } cases[] = {
        {NULL, KVW_VERIFY_OFF, 0},
        {"off", KVW_VERIFY_OFF, 0},
        {"every", KVW_VERIFY_EVERY, 1000000},
        {"sample:0.1", KVW_VERIFY_SAMPLE, 100000},
        {"sample:0.25", KVW_VERIFY_SAMPLE, 250000},
        {"sample:0.000001", KVW_VERIFY_SAMPLE, 1},
        {"sample:0", KVW_VERIFY_SAMPLE, 0},
        {"sample:1", KVW_VERIFY_SAMPLE, 1000000},
        {"sample:01.0", KVW_VERIFY_SAMPLE, 1000000},
    };
    for (size_t i = 0; i < KVW_ARRAY_SIZE(cases); i++) {
        int mode = -1;
        uint32_t ppm = 7;
        const char *why = kvw__verify_parse(cases[i].text, &mode, &ppm);
        CHECK(why == NULL && mode == cases[i].mode && ppm == cases[i].ppm,
              "verify '%s': %s, mode %d, %u ppm (want %d, %u)",
              cases[i].text ? cases[i].text : "(null)", why ? why : "ok", mode, ppm,
              cases[i].mode, cases[i].ppm);
    }
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    check_verify_parse();
    check_table();
    check_defaults();
    check_accepted();
    check_refused();
    check_context();
    return ip_summary("test_config");
}
