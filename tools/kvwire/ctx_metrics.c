/* The CLI's view of kvw_ctx_metrics: one block of lines per context, for `kvwire demo
 * --metrics` and `kvwire bench --metrics`. */
#include "util.h"

#include <stdio.h>
#include <string.h>

/* "12.3 MiB"-style sizes. */
static const char *cli_size(uint64_t b, char *buf, size_t cap)
{
    if (b < 1024)
        snprintf(buf, cap, "%llu B", (unsigned long long)b);
    else if (b < (1ull << 20))
        snprintf(buf, cap, "%.1f KiB", b / 1024.0);
    else if (b < (1ull << 30))
        snprintf(buf, cap, "%.1f MiB", b / 1048576.0);
    else
        snprintf(buf, cap, "%.2f GiB", b / 1073741824.0);
    return buf;
}

/* The upper bound (us) of the histogram bucket where the running count reaches q of
 * `total`: the percentile, at most a factor of two high; 0 for the last, open bucket. */
static uint64_t cli_pct_us(const uint64_t *h, uint64_t total, double q)
{
    uint64_t run = 0;
    for (unsigned i = 0; i < KVW_CTX_METRICS_LATENCY_BUCKETS; i++) {
        run += h[i];
        if ((double)run >= q * (double)total)
            return i + 1 < KVW_CTX_METRICS_LATENCY_BUCKETS ? 1ull << i : 0;
    }
    return 0;
}

static void cli_pct(char *buf, size_t cap, const char *name, uint64_t us)
{
    if (us)
        snprintf(buf, cap, "%s < %llu us", name, (unsigned long long)us);
    else
        snprintf(buf, cap, "%s >= %llu us", name, 1ull << (KVW_CTX_METRICS_LATENCY_BUCKETS - 2));
}

void cli_print_metrics(FILE *f, const char *who, uint32_t rank, kvw_ctx_h ctx)
{
    kvw_ctx_metrics_t m = {.field_mask = KVW_CTX_METRICS_FIELDS_ALL};
    if (kvw_ctx_metrics(ctx, &m) != KVW_OK) {
        fprintf(f, "metrics: %s rank %u: %s\n", who, rank, kvw_last_error());
        return;
    }
    char out[2048], fails[512] = "none", a[32], b[32], c[32], p50[48], p90[48], p99[48];
    size_t fl = 0;
    for (unsigned i = 0; i < KVW_CTX_METRICS_STATUS_SLOTS; i++)
        if (m.rooms_failed_by_status[i] && fl < sizeof(fails))
            fl += (size_t)snprintf(fails + fl, sizeof(fails) - fl, "%s%s %llu", fl ? ", " : "",
                                   i ? kvw_status_string((kvw_status_t) - (int)i) : "other",
                                   (unsigned long long)m.rooms_failed_by_status[i]);
    uint64_t n = 0;
    for (unsigned i = 0; i < KVW_CTX_METRICS_LATENCY_BUCKETS; i++)
        n += m.latency_us_buckets[i];
    cli_pct(p50, sizeof(p50), "p50", cli_pct_us(m.latency_us_buckets, n, 0.50));
    cli_pct(p90, sizeof(p90), "p90", cli_pct_us(m.latency_us_buckets, n, 0.90));
    cli_pct(p99, sizeof(p99), "p99", cli_pct_us(m.latency_us_buckets, n, 0.99));
    int len = snprintf(
        out, sizeof(out),
        "metrics: %s rank %u over %s: rooms %llu ok, %llu failed; in flight %llu "
        "bootstrapping, %llu waiting, %llu transferring\n"
        "metrics:   failures by status: %s\n"
        "metrics:   bytes: %llu direct, %llu staged\n",
        who, rank, m.transport, (unsigned long long)m.rooms_succeeded,
        (unsigned long long)m.rooms_failed, (unsigned long long)m.rooms_in_state[0],
        (unsigned long long)m.rooms_in_state[1], (unsigned long long)m.rooms_in_state[2], fails,
        (unsigned long long)m.bytes_direct, (unsigned long long)m.bytes_staged);
    if (n)
        len += snprintf(out + len, sizeof(out) - (size_t)len,
                        "metrics:   latency post -> Success: %llu rooms, mean %llu us, %s, %s, "
                        "%s\n",
                        (unsigned long long)n, (unsigned long long)(m.latency_us_sum / n), p50,
                        p90, p99);
    else
        len += snprintf(out + len, sizeof(out) - (size_t)len,
                        "metrics:   latency post -> Success: no room succeeded\n");
    if (m.staging_capacity)
        len += snprintf(out + len, sizeof(out) - (size_t)len,
                        "metrics:   staging: %s in use of %s, high water %s\n",
                        cli_size(m.staging_in_use, a, sizeof(a)),
                        cli_size(m.staging_capacity, b, sizeof(b)),
                        cli_size(m.staging_high_water, c, sizeof(c)));
    if (m.rooms_verified || m.rooms_verify_skipped || m.rooms_verify_failed)
        len += snprintf(out + len, sizeof(out) - (size_t)len,
                        "metrics:   KV verification: %llu rooms verified, %llu sampled out, "
                        "%llu failed\n", (unsigned long long)m.rooms_verified,
                        (unsigned long long)m.rooms_verify_skipped,
                        (unsigned long long)m.rooms_verify_failed);
    snprintf(out + len, sizeof(out) - (size_t)len, "metrics:   peers: %llu connected, %llu died\n",
             (unsigned long long)m.peers_connected, (unsigned long long)m.peers_died);
    fputs(out, f);
    fflush(f);
}
