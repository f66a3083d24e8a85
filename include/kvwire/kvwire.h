/*
 * kvwire — move the KV cache of LLM requests from prefill workers to decode workers.
 *
 * This header describes a rank's KV cache (model, parallel configuration, buffers),
 * computes head ownership and routes between two topologies, builds compact transfer
 * plans and executes them on the CPU. The transfer protocol lives in kvwire/xfer.h.
 *
 * Conventions: every function returns kvw_status_t; output arguments end in _p, come
 * last and are written only on success. On error, kvw_last_error() returns a message
 * for the calling thread that names the offending values. The library never prints.
 *
 * Field masks. Every struct that crosses the API starts with `uint64_t field_mask`, one
 * bit per field (KVW_<STRUCT>_FIELD_*; KVW_<STRUCT>_FIELDS_ALL has every bit this header
 * knows). In a struct the caller passes in, a field whose bit is clear is not read: it
 * takes the default its comment documents, or, where it is required, the call fails
 * with INVALID_PARAM and a message naming the struct and the field. A mask with a bit
 * this library does not know is refused with INVALID_PARAM and a message naming the
 * struct and the unknown bits, so a program built against newer headers fails clearly
 * on an older library instead of having a field ignored. Structs the library fills
 * come in two kinds: a request (kvw_room_metrics_t, kvw_plan_stats_t), whose mask the
 * caller sets to the fields it wants, and a report (kvw_route_t, kvw_run_t,
 * kvw_config_var_t, kvw_cuda_profile_t), whose mask the library sets to the fields it
 * filled. A nested struct (kvw_side_pages_t in kvw_send_chunk_t, ...) carries its own
 * mask, read only when the outer struct's bit for it is set.
 *
 * Layout. A struct passed singly may gain fields at its end in a later minor version:
 * the library reads a field only when its bit is set, so a caller built against older
 * headers still works. Element structs of arrays (kvw_layer_desc_t, kvw_buffer_desc_t,
 * kvw_state_group_t, kvw_route_t, kvw_config_var_t) and structs embedded in others
 * (kvw_pages_t, kvw_side_pages_t, kvw_parallel_t) keep their size, hence the stride of
 * their arrays, within one SONAME major version (libkvwire.so.0); growing them takes a
 * new major.
 */
#ifndef KVWIRE_KVWIRE_H
#define KVWIRE_KVWIRE_H

#include <kvwire/version.h>

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVW_BUILDING) && defined(__GNUC__)
#define KVW_API __attribute__((visibility("default")))
#else
#define KVW_API
#endif

/*
 * One status enum. OK is 0, INPROGRESS is 1, errors are negative and grouped by what
 * they break: -1..-19 a call or its arguments, -20..-39 one room (request), -40..-59 one
 * connection, -60.. the whole context.
 */
#define KVW_STATUS_TABLE(X)                                                          \
    X(OK, 0, "success")                                                              \
    X(INPROGRESS, 1, "operation in progress")                                        \
    X(ERR_INVALID_PARAM, -1, "invalid parameter")                                    \
    X(ERR_NO_MEMORY, -2, "out of memory")                                            \
    X(ERR_UNSUPPORTED, -3, "unsupported")                                            \
    X(ERR_INCOMPATIBLE, -4, "incompatible model, layout or topology")               \
    X(ERR_OUT_OF_RANGE, -5, "index or range out of bounds")                          \
    X(ERR_BUFFER_TOO_SMALL, -6, "output buffer too small")                           \
    X(ERR_NOT_FOUND, -7, "not found")                                                \
    X(ERR_BUSY, -8, "resource busy")                                                 \
    X(ERR_TIMEOUT, -20, "timed out")                                                 \
    X(ERR_ABORTED, -21, "aborted")                                                   \
    X(ERR_REMOTE_FAILED, -22, "the peer reported a failure")                         \
    X(ERR_BYTE_MISMATCH, -23, "byte count mismatch")                                 \
    X(ERR_MALFORMED, -40, "malformed frame")                                         \
    X(ERR_IO, -41, "I/O error")                                                      \
    X(ERR_CONN_CLOSED, -42, "connection closed")                                     \
    X(ERR_REJECTED, -43, "rejected by peer")                                         \
    X(ERR_AUTH, -44, "authentication failed")                                        \
    X(ERR_PEER_DEAD, -45, "peer stopped answering")                                  \
    X(ERR_INTERNAL, -60, "internal error")                                           \
    X(ERR_SHUTDOWN, -61, "context is shutting down")

typedef enum kvw_status {
#define KVW_X_ENUM(name, value, text) KVW_##name = value,
    KVW_STATUS_TABLE(KVW_X_ENUM)
#undef KVW_X_ENUM
} kvw_status_t;

/* Short fixed text for a status (never NULL). */
KVW_API const char *kvw_status_string(kvw_status_t status);

/* Detailed message of the last error raised in the calling thread ("" if none). */
KVW_API const char *kvw_last_error(void);

/*
 * A log hook. kvwire prints nothing itself: events an operator wants to see (a room that
 * failed and why, a peer declared dead, a registration refused) go to the handler set
 * here, at levels up to `max_level`. The handler runs on kvwire's threads, possibly with
 * a context's lock held: it must return quickly and must not call kvwire. NULL removes
 * it. `msg` is valid during the call only.
 */
typedef enum kvw_log_level {
    KVW_LOG_ERROR = 0,
    KVW_LOG_WARN = 1,
    KVW_LOG_INFO = 2,
    KVW_LOG_DEBUG = 3
} kvw_log_level_t;
typedef void (*kvw_log_fn)(void *arg, kvw_log_level_t level, const char *msg);
KVW_API void kvw_set_log_handler(kvw_log_fn fn, void *arg, kvw_log_level_t max_level);

/* Version of the loaded library, "MAJOR.MINOR.PATCH" (static storage, never NULL). It
 * may differ from KVW_VERSION_STRING, the version of the headers a program was compiled
 * against, when the program runs with another build of the shared library. */
KVW_API const char *kvw_version(void);

/* The same as one number, MAJOR * 10000 + MINOR * 100 + PATCH (see KVW_VERSION_NUMBER). */
KVW_API uint32_t kvw_version_number(void);

/* ---------------------------------------------------------------- model */

typedef enum kvw_layer_kind {
    KVW_LAYER_NONE = 0, /* holds no KV cache (e.g. an MLP-only layer) */
    KVW_LAYER_FULL = 1, /* full attention (MHA/GQA) */
    KVW_LAYER_SWA = 2,  /* sliding-window attention */
    KVW_LAYER_MLA = 3,  /* multi-head latent attention: one replicated latent row */
    KVW_LAYER_STATE = 4 /* linear attention (Mamba/GDN): per-request state slots */
} kvw_layer_kind_t;

enum {
    KVW_LAYER_FIELD_KIND = 1u << 0,  /* required */
    KVW_LAYER_FIELD_WINDOW = 1u << 1 /* default 0; required for SWA layers */
};
#define KVW_LAYER_FIELDS_ALL 0x3ull

typedef struct kvw_layer_desc {
    uint64_t field_mask; /* KVW_LAYER_FIELD_* */
    kvw_layer_kind_t kind;
    uint32_t window; /* tokens, SWA layers only */
} kvw_layer_desc_t;

enum {
    KVW_MODEL_FIELD_NUM_LAYERS = 1u << 0, /* required */
    KVW_MODEL_FIELD_LAYERS = 1u << 1,     /* required */
    KVW_MODEL_FIELD_NUM_KV_HEADS = 1u << 2,
    KVW_MODEL_FIELD_K_HEAD_DIM = 1u << 3,
    KVW_MODEL_FIELD_V_HEAD_DIM = 1u << 4,
    KVW_MODEL_FIELD_MLA_DIM = 1u << 5,
    KVW_MODEL_FIELD_ELEM_SIZE = 1u << 6, /* required */
    KVW_MODEL_FIELD_SCALE_BLOCK = 1u << 7,
    KVW_MODEL_FIELD_SCALE_ELEM_SIZE = 1u << 8
};
#define KVW_MODEL_FIELDS_ALL 0x1ffull

/*
 * What both sides must agree on. Compared field by field at the handshake.
 * Head dims and mla_dim are in elements; sizes in bytes. Optional fields default to 0
 * (no attention heads, no latent row, no block scales); a 0 the layers need is refused
 * when the rank is created, naming the field.
 */
typedef struct kvw_model {
    uint64_t field_mask; /* KVW_MODEL_FIELD_* */
    uint32_t num_layers;
    const kvw_layer_desc_t *layers; /* num_layers entries, indexed by global layer id */
    uint32_t num_kv_heads;          /* total KV heads of attention layers */
    uint32_t k_head_dim;
    uint32_t v_head_dim;
    uint32_t mla_dim;         /* latent row width (kv_lora_rank + rope dim), MLA layers */
    uint32_t elem_size;       /* bytes per element: 2 for bf16, 1 for fp8 */
    uint32_t scale_block;     /* 0: no block scales; else elements per scale (32: MXFP8) */
    uint32_t scale_elem_size; /* bytes per scale value */
} kvw_model_t;

/* ---------------------------------------------------------------- parallel config */

enum {
    KVW_PARALLEL_FIELD_TP_SIZE = 1u << 0,     /* default 1 */
    KVW_PARALLEL_FIELD_TP_RANK = 1u << 1,     /* default 0 */
    KVW_PARALLEL_FIELD_PP_SIZE = 1u << 2,     /* default 1 */
    KVW_PARALLEL_FIELD_PP_RANK = 1u << 3,     /* default 0 */
    KVW_PARALLEL_FIELD_LAYER_BEGIN = 1u << 4, /* default 0 */
    KVW_PARALLEL_FIELD_LAYER_END = 1u << 5,   /* default: the model's num_layers */
    KVW_PARALLEL_FIELD_DP_SIZE = 1u << 6,     /* default 1 */
    KVW_PARALLEL_FIELD_DP_RANK = 1u << 7      /* default 0 */
};
#define KVW_PARALLEL_FIELDS_ALL 0xffull

typedef struct kvw_parallel {
    uint64_t field_mask;       /* KVW_PARALLEL_FIELD_* */
    uint32_t tp_size, tp_rank; /* attention TP inside one DP group */
    uint32_t pp_size, pp_rank;
    uint32_t layer_begin, layer_end; /* global layer range [begin, end) of this PP stage */
    uint32_t dp_size, dp_rank;
} kvw_parallel_t;

/* ---------------------------------------------------------------- buffers */

typedef enum kvw_pool {
    KVW_POOL_FULL = 0, /* full attention and MLA pages */
    KVW_POOL_SWA = 1,  /* sliding-window pages */
    KVW_POOL_STATE = 2 /* per-request state slots */
} kvw_pool_t;
#define KVW_NUM_POOLS 3

typedef enum kvw_role {
    KVW_ROLE_K = 0,
    KVW_ROLE_V = 1,
    KVW_ROLE_KV = 2, /* fused: each page is [K part][V part], each in the buffer's layout */
    KVW_ROLE_LATENT = 3,
    KVW_ROLE_STATE = 4,
    KVW_ROLE_K_SCALE = 5,
    KVW_ROLE_V_SCALE = 6
} kvw_role_t;

typedef enum kvw_layout {
    KVW_LAYOUT_NHD = 0, /* [page][token][head][bytes] */
    KVW_LAYOUT_HND = 1, /* [page][head][token][bytes] */
    /* Layouts that engines use but kvwire cannot address safely; describing them
     * honestly gets a clear rejection instead of silently wrong bytes. */
    KVW_LAYOUT_VECTORIZED_5D = 2
} kvw_layout_t;

typedef enum kvw_mem_kind { KVW_MEM_HOST = 0, KVW_MEM_CUDA = 1 } kvw_mem_kind_t;

#define KVW_MAX_STATE_GROUPS 8

/*
 * A state tensor's slot is sharded along its outermost axis, possibly as several
 * groups side by side (GDN conv state [q | k | v]). Each group is sharded on its own
 * with the head ownership rule; a rank's slot holds its units of group 0, then of
 * group 1, and so on.
 */
enum {
    KVW_STATE_GROUP_FIELD_TOTAL_HEADS = 1u << 0, /* required */
    KVW_STATE_GROUP_FIELD_HEAD_BYTES = 1u << 1   /* required */
};
#define KVW_STATE_GROUP_FIELDS_ALL 0x3ull

typedef struct kvw_state_group {
    uint64_t field_mask;  /* KVW_STATE_GROUP_FIELD_*; read for groups < num_groups only */
    uint32_t total_heads; /* units of the sharded axis across all TP ranks */
    uint32_t head_bytes;  /* bytes per unit */
} kvw_state_group_t;

enum {
    KVW_BUFFER_FIELD_POOL = 1u << 0,   /* default KVW_POOL_FULL */
    KVW_BUFFER_FIELD_LAYER = 1u << 1,  /* required */
    KVW_BUFFER_FIELD_ROLE = 1u << 2,   /* required */
    KVW_BUFFER_FIELD_LAYOUT = 1u << 3, /* default KVW_LAYOUT_NHD */
    KVW_BUFFER_FIELD_PAGE_SIZE = 1u << 4,    /* default 0 (state pools) */
    KVW_BUFFER_FIELD_NUM_HEADS = 1u << 5,    /* default 0 (state pools) */
    KVW_BUFFER_FIELD_HEAD_BYTES = 1u << 6,   /* default 0 (state pools) */
    KVW_BUFFER_FIELD_V_HEAD_BYTES = 1u << 7, /* default 0 (roles other than KV) */
    KVW_BUFFER_FIELD_GROUPS = 1u << 8,       /* num_groups and groups; default none */
    KVW_BUFFER_FIELD_ADDR = 1u << 9,         /* default NULL */
    KVW_BUFFER_FIELD_LENGTH = 1u << 10,      /* required */
    KVW_BUFFER_FIELD_MEM_KIND = 1u << 11,    /* default KVW_MEM_HOST */
    KVW_BUFFER_FIELD_DEVICE = 1u << 12       /* default 0 */
};
#define KVW_BUFFER_FIELDS_ALL 0x1fffull

/* Zero defaults a buffer's pool needs (a paged pool's page size, heads, head bytes) are
 * refused when the rank is created, naming the field. */
typedef struct kvw_buffer_desc {
    uint64_t field_mask; /* KVW_BUFFER_FIELD_* */
    kvw_pool_t pool;
    uint32_t layer; /* global layer id */
    kvw_role_t role;
    kvw_layout_t layout;
    uint32_t page_size;  /* tokens per page (paged pools) */
    uint32_t num_heads;  /* heads held by this rank (paged pools) */
    uint32_t head_bytes; /* bytes per head per token; for KV: the K part */
    uint32_t v_head_bytes; /* KV only: bytes per head per token of the V part */
    uint32_t num_groups;   /* state only */
    kvw_state_group_t groups[KVW_MAX_STATE_GROUPS];
    void *addr;      /* local address (ignored for descriptions of remote buffers) */
    uint64_t length; /* bytes; must be a whole number of pages (or slots) */
    kvw_mem_kind_t mem_kind;
    int32_t device; /* CUDA device ordinal, KVW_MEM_CUDA only */
} kvw_buffer_desc_t;

/* ---------------------------------------------------------------- rank description */

typedef struct kvw_rank *kvw_rank_h;

enum {
    KVW_RANK_FIELD_MODEL = 1u << 0,
    KVW_RANK_FIELD_PARALLEL = 1u << 1,
    KVW_RANK_FIELD_BUFFERS = 1u << 2
};

#define KVW_RANK_FIELDS_ALL 0x7ull

typedef struct kvw_rank_params {
    uint64_t field_mask; /* KVW_RANK_FIELD_*; all three are required */
    const kvw_model_t *model;
    kvw_parallel_t parallel;
    const kvw_buffer_desc_t *buffers;
    uint32_t num_buffers;
} kvw_rank_params_t;

/*
 * Validates and copies a rank's description (the model, its layers and the buffer
 * table are copied with every default filled in, so the structs kvw_rank_model,
 * kvw_rank_parallel and kvw_rank_buffer return have every field_mask bit set; the
 * memory they describe is not copied). Errors: INVALID_PARAM,
 * INCOMPATIBLE (heads not divisible by TP, buffer geometry that contradicts the model),
 * UNSUPPORTED (layout), NO_MEMORY.
 */
KVW_API kvw_status_t kvw_rank_create(const kvw_rank_params_t *params, kvw_rank_h *rank_p);
KVW_API void kvw_rank_destroy(kvw_rank_h rank);
KVW_API const kvw_model_t *kvw_rank_model(kvw_rank_h rank);
KVW_API const kvw_parallel_t *kvw_rank_parallel(kvw_rank_h rank);
KVW_API uint32_t kvw_rank_num_buffers(kvw_rank_h rank);
KVW_API const kvw_buffer_desc_t *kvw_rank_buffer(kvw_rank_h rank, uint32_t index);

/*
 * Checks that a source and a destination rank can exchange KV caches: same model,
 * matching buffers for every layer both hold, supported layouts. The message names
 * the first difference. Errors: INCOMPATIBLE, UNSUPPORTED.
 */
KVW_API kvw_status_t kvw_rank_check_compatible(kvw_rank_h src, kvw_rank_h dst);

/* ---------------------------------------------------------------- topology */

enum {
    KVW_ROUTE_FIELD_SRC_RANK = 1u << 0,
    KVW_ROUTE_FIELD_DST_RANK = 1u << 1,
    KVW_ROUTE_FIELD_SRC_HEAD_START = 1u << 2,
    KVW_ROUTE_FIELD_DST_HEAD_START = 1u << 3,
    KVW_ROUTE_FIELD_NUM_HEADS = 1u << 4
};
#define KVW_ROUTE_FIELDS_ALL 0x1full

/* A report: the library sets field_mask to the fields it filled. */
typedef struct kvw_route {
    uint64_t field_mask; /* KVW_ROUTE_FIELD_* */
    uint32_t src_rank, dst_rank;
    uint32_t src_head_start; /* offset inside the source rank's own heads */
    uint32_t dst_head_start; /* offset inside the destination rank's own heads */
    uint32_t num_heads;
} kvw_route_t;

/*
 * Heads owned by rank `rank` of `tp_size` for `num_heads` total heads:
 * [*first_p, *first_p + *count_p). Errors: INCOMPATIBLE (neither H % T nor T % H is 0),
 * INVALID_PARAM.
 */
KVW_API kvw_status_t kvw_topo_heads(uint32_t tp_size, uint32_t rank, uint32_t num_heads,
                                    uint32_t *first_p, uint32_t *count_p);

/*
 * All routes from a source TP group to a destination TP group, ordered by destination
 * rank then destination head. *count_p receives the number of routes even when
 * `capacity` is too small (then BUFFER_TOO_SMALL). For MLA pass num_heads = 1.
 */
KVW_API kvw_status_t kvw_topo_routes(uint32_t src_tp, uint32_t dst_tp, uint32_t num_heads,
                                     kvw_route_t *routes, size_t capacity, size_t *count_p);

/* ---------------------------------------------------------------- requests */

/* Pages of one pool for one request on one side: page i holds tokens
 * [first_token + i * page_size, first_token + (i + 1) * page_size). first_token must
 * be a multiple of the pool's page size. */
enum {
    KVW_PAGES_FIELD_PAGES = 1u << 0,      /* default NULL */
    KVW_PAGES_FIELD_NUM_PAGES = 1u << 1,  /* default 0 */
    KVW_PAGES_FIELD_FIRST_TOKEN = 1u << 2 /* default 0 */
};
#define KVW_PAGES_FIELDS_ALL 0x7ull

typedef struct kvw_pages {
    uint64_t field_mask; /* KVW_PAGES_FIELD_* */
    const uint32_t *pages;
    uint32_t num_pages;
    uint64_t first_token;
} kvw_pages_t;

enum {
    KVW_SIDE_PAGES_FIELD_FULL = 1u << 0,      /* default: no pages */
    KVW_SIDE_PAGES_FIELD_SWA = 1u << 1,       /* default: no pages */
    KVW_SIDE_PAGES_FIELD_STATE_SLOT = 1u << 2 /* default -1 */
};
#define KVW_SIDE_PAGES_FIELDS_ALL 0x7ull

typedef struct kvw_side_pages {
    uint64_t field_mask; /* KVW_SIDE_PAGES_FIELD_* */
    kvw_pages_t full;   /* full-attention and MLA pool */
    kvw_pages_t swa;    /* sliding-window pool */
    int64_t state_slot; /* slot in every state buffer, or -1 if the request has none */
} kvw_side_pages_t;

/*
 * One request, or one chunk of it. Full-attention and MLA layers move tokens
 * [max(chunk_begin, prefix_len), chunk_end). On the last chunk only: SWA layers move
 * [max(num_tokens - window, prefix_len, 0), num_tokens), and state slots move.
 */
enum {
    KVW_CHUNK_FIELD_NUM_TOKENS = 1u << 0,  /* required */
    KVW_CHUNK_FIELD_CHUNK_BEGIN = 1u << 1, /* default 0 */
    KVW_CHUNK_FIELD_CHUNK_END = 1u << 2,   /* default num_tokens */
    KVW_CHUNK_FIELD_PREFIX_LEN = 1u << 3,  /* default 0 */
    KVW_CHUNK_FIELD_LAST_CHUNK = 1u << 4   /* default: chunk_end == num_tokens */
};
#define KVW_CHUNK_FIELDS_ALL 0x1full

typedef struct kvw_chunk {
    uint64_t field_mask; /* KVW_CHUNK_FIELD_* */
    uint64_t num_tokens; /* total tokens of the request */
    uint64_t chunk_begin, chunk_end;
    uint64_t prefix_len; /* tokens the decode side already holds */
    int last_chunk;
} kvw_chunk_t;

/* ---------------------------------------------------------------- plans */

typedef struct kvw_plan *kvw_plan_h;

enum {
    KVW_PLAN_STATS_FIELD_BYTES = 1u << 0,
    KVW_PLAN_STATS_FIELD_NUM_ROUTES = 1u << 1,
    KVW_PLAN_STATS_FIELD_NUM_SEGMENTS = 1u << 2,
    KVW_PLAN_STATS_FIELD_RUNS_RAW = 1u << 3,
    KVW_PLAN_STATS_FIELD_RUNS_COALESCED = 1u << 4, /* the only one that walks the plan */
    KVW_PLAN_STATS_FIELD_PLAN_BYTES = 1u << 5
};
#define KVW_PLAN_STATS_FIELDS_ALL 0x3full

/* A request: the caller sets field_mask to the fields it wants; kvw_plan_stats fills
 * exactly those and leaves the others untouched. */
typedef struct kvw_plan_stats {
    uint64_t field_mask;     /* KVW_PLAN_STATS_FIELD_* wanted */
    uint64_t bytes;          /* payload bytes the plan moves */
    uint32_t num_routes;     /* distinct head routes used */
    uint64_t num_segments;   /* compact entries (buffer pair x route x pool) */
    uint64_t runs_raw;       /* elementary copies (one head slice of one token, or less) */
    uint64_t runs_coalesced; /* after merging adjacent runs */
    uint64_t plan_bytes;     /* memory held by the plan */
} kvw_plan_stats_t;

enum {
    KVW_RUN_FIELD_SRC_BUF = 1u << 0,
    KVW_RUN_FIELD_DST_BUF = 1u << 1,
    KVW_RUN_FIELD_SRC_OFF = 1u << 2,
    KVW_RUN_FIELD_DST_OFF = 1u << 3,
    KVW_RUN_FIELD_LEN = 1u << 4
};
#define KVW_RUN_FIELDS_ALL 0x1full

/* One contiguous copy: buffer indices refer to each rank's buffer table. A report: the
 * library sets field_mask to the fields it filled. */
typedef struct kvw_run {
    uint64_t field_mask; /* KVW_RUN_FIELD_* */
    uint32_t src_buf, dst_buf;
    uint64_t src_off, dst_off, len;
} kvw_run_t;

/*
 * Builds the compact plan for one chunk from source rank `src` to destination rank
 * `dst` (same DP group assumed). Everything is validated before any byte moves:
 * compatibility, page lists long enough, page indices inside their buffers, no
 * destination page listed twice. The plan keeps references to both rank handles,
 * which must outlive it. Errors: INCOMPATIBLE, UNSUPPORTED, OUT_OF_RANGE,
 * INVALID_PARAM, NO_MEMORY.
 */
KVW_API kvw_status_t kvw_plan_create(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                     const kvw_side_pages_t *src_pages,
                                     const kvw_side_pages_t *dst_pages, kvw_plan_h *plan_p);
KVW_API void kvw_plan_destroy(kvw_plan_h plan);

/* Fills the fields stats_p->field_mask asks for; counting coalesced runs walks the plan
 * once (no allocation). Errors: INVALID_PARAM (NULL argument, unknown bits). */
KVW_API kvw_status_t kvw_plan_stats(kvw_plan_h plan, kvw_plan_stats_t *stats_p);

/*
 * Expands the plan into coalesced runs, calling `cb` for each in order. A non-OK
 * return from cb stops the walk and is returned.
 */
typedef kvw_status_t (*kvw_run_cb_t)(void *arg, const kvw_run_t *run);
KVW_API kvw_status_t kvw_plan_expand(kvw_plan_h plan, kvw_run_cb_t cb, void *arg);

/* Copies every byte of the plan between the two ranks' host buffers (both must be
 * KVW_MEM_HOST with valid addresses). */
KVW_API kvw_status_t kvw_plan_exec_cpu(kvw_plan_h plan);

#ifdef __cplusplus
}
#endif

#endif /* KVWIRE_KVWIRE_H */
