/*
 * Test kit shared by the CLI, the tests and the benchmarks: model presets, a rank
 * builder that allocates guarded host buffers, deterministic fill patterns, random page
 * tables and an independent, deliberately naive reference transfer.
 *
 * The reference (kvt_ref_transfer) derives head ownership and source selection from
 * DESIGN.md section 3 by itself and copies one (token, head) slice at a time. It never
 * calls kvw_topo_* or the plan code, so that a test comparing the two checks the
 * library against a second, independent reading of the rules.
 *
 * Functions print nothing, return 0 / KVW_OK on success and describe failures in a
 * caller-provided message buffer where one exists. The installed CLI links everything
 * here but check.c (kvt_expect_failure), which is for the tests only (CMakeLists.txt).
 */
#ifndef KVW_TESTKIT_H
#define KVW_TESTKIT_H

#include <kvwire/kvwire.h>

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- PRNG and hashing */

/* splitmix64: tiny, seedable, good enough to scatter pages and fill buffers. */
typedef struct kvt_rng {
    uint64_t state;
} kvt_rng_t;

static inline uint64_t kvt_mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t kvt_rng_next(kvt_rng_t *rng)
{
    rng->state += 0x9e3779b97f4a7c15ull;
    uint64_t z = rng->state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform value in [0, n), n > 0 (rejection sampling, no modulo bias). */
uint64_t kvt_rng_below(kvt_rng_t *rng, uint64_t n);

/* ---------------------------------------------------------------- models */

#define KVT_MAX_LAYERS 128
#define KVT_MAX_STATE_BUFS 4

/* Shape of one state tensor of a STATE layer (the same for every STATE layer). */
typedef struct kvt_state_shape {
    uint32_t num_groups;
    kvw_state_group_t groups[KVW_MAX_STATE_GROUPS];
} kvt_state_shape_t;

/*
 * A model plus storage for its layer table and its state tensor shapes. `m.layers`
 * points into `layers`: after copying a kvt_model_t by value, call kvt_model_relink.
 */
typedef struct kvt_model {
    char name[48];
    kvw_model_t m;
    kvw_layer_desc_t layers[KVT_MAX_LAYERS];
    uint32_t num_state_bufs; /* state tensors per STATE layer */
    kvt_state_shape_t state[KVT_MAX_STATE_BUFS];
} kvt_model_t;

/* Fills *model_p with the preset `name` (see kvt_model_names). Returns 0, or -1 for an
 * unknown name. */
int kvt_model_preset(const char *name, kvt_model_t *model_p);

/* NULL-terminated list of preset names. */
const char *const *kvt_model_names(void);

/* Points model->m.layers at model->layers again (after a struct copy). */
void kvt_model_relink(kvt_model_t *model);

/* Keeps the first `num_layers` layers (scaled-down models for tests and demos).
 * Returns 0, or -1 if num_layers is 0 or larger than the model. */
int kvt_model_truncate(kvt_model_t *model, uint32_t num_layers);

/* The preset `name` with its first `layers` layers (0: all), for a command-line tool's
 * --model and --layers: returns 0, or -1 after saying why on stderr as "<who>: ..." (an
 * unknown name, with the presets listed; more layers than the model has). */
int kvt_model_load(const char *who, const char *name, uint32_t layers, kvt_model_t *model_p);

/* Turns the model's KV cache into an MXFP8-like format: 1-byte elements with one
 * `scale_elem_size`-byte scale per `block` elements of every head of every token. */
void kvt_model_set_block_scale(kvt_model_t *model, uint32_t block, uint32_t scale_elem_size);

/* ---------------------------------------------------------------- head ownership */

/*
 * DESIGN.md section 3, written out again on purpose (tests must not trust the library's
 * own topology code): the heads [*first, *first + *count) that rank `rank` of `tp` owns
 * out of `heads`. Returns 0, or -1 when neither heads % tp nor tp % heads is 0.
 */
int kvt_heads_owned(uint32_t tp, uint32_t rank, uint32_t heads, uint32_t *first, uint32_t *count);

/* The source TP rank that destination TP rank `dst_rank` reads global head `head` from:
 * the k-th destination rank (in rank order) needing the head reads replica k mod rep_S. */
uint32_t kvt_source_rank(uint32_t src_tp, uint32_t dst_tp, uint32_t heads, uint32_t dst_rank,
                         uint32_t head);

/* ---------------------------------------------------------------- rank builder */

typedef struct kvt_rank_spec {
    const kvt_model_t *model;
    kvw_parallel_t par;     /* tp/pp/dp size and rank, layer range */
    kvw_layout_t layout;    /* layout of every paged buffer */
    uint32_t page_size[2];  /* tokens per page: [KVW_POOL_FULL], [KVW_POOL_SWA] */
    uint32_t num_pages[2];  /* pages per pool */
    uint32_t num_slots;     /* state slots per state buffer */
    int fused_kv;           /* one KVW_ROLE_KV buffer per layer instead of K and V */
    int describe_only;      /* fake non-NULL addresses, nothing allocated */
    uint32_t guard_bytes;   /* 0: 64 guard bytes before and after each buffer */
} kvt_rank_spec_t;

typedef struct kvt_rank {
    kvt_model_t model;
    kvw_parallel_t par;
    kvw_layout_t layout;
    uint32_t page_size[2];
    kvw_rank_h h; /* NULL until kvt_rank_open succeeds */
    uint32_t num_bufs;
    kvw_buffer_desc_t *bufs; /* the table given to kvw_rank_create (editable before open) */
    uint8_t **mem;           /* per buffer: start of the guarded allocation, or NULL */
    uint64_t *alloc_len;     /* per buffer: bytes between the guards when allocated */
    uint32_t guard;
    int describe_only;
} kvt_rank_t;

/*
 * Builds the buffer table of one rank and allocates each buffer with guard bytes
 * before and after it (filled with a sentinel), without creating the kvw_rank_h.
 * Buffers, per layer in the rank's layer range, in this order: FULL/SWA: K and V (or
 * one fused KV), then K_SCALE and V_SCALE when the model has scale_block; MLA: the
 * latent; STATE: one buffer per state shape. Returns KVW_OK, INVALID_PARAM or NO_MEMORY.
 */
kvw_status_t kvt_rank_describe(const kvt_rank_spec_t *spec, kvt_rank_t *rank_p);

/* kvw_rank_create on the rank's (possibly edited) buffer table. Returns its status. */
kvw_status_t kvt_rank_open(kvt_rank_t *rank);

/* kvt_rank_describe followed by kvt_rank_open (freeing everything on failure). */
kvw_status_t kvt_rank_build(const kvt_rank_spec_t *spec, kvt_rank_t *rank_p);

/* Destroys the handle (if any) and frees the buffers. Safe on a zeroed struct. */
void kvt_rank_free(kvt_rank_t *rank);

/* Checks every guard byte. Returns 0, or -1 and a message naming buffer and offset. */
int kvt_rank_check_guards(const kvt_rank_t *rank, char *msg, size_t cap);

/* Fills every buffer with a pattern that depends on (seed, buffer index, offset). */
void kvt_rank_fill(kvt_rank_t *rank, uint64_t seed);

/* Checks that every buffer still holds kvt_rank_fill's pattern for `seed`. */
int kvt_rank_verify_fill(const kvt_rank_t *rank, uint64_t seed, char *msg, size_t cap);

/* Sets every byte of every buffer to `value`. */
void kvt_rank_clear(kvt_rank_t *rank, uint8_t value);

/* Data pointer of buffer i (NULL for describe-only ranks). */
uint8_t *kvt_rank_data(const kvt_rank_t *rank, uint32_t i);

/* The fill pattern itself, for tests that build their own buffers. */
void kvt_fill_pattern(void *dst, uint64_t len, uint64_t seed, uint64_t stream);

/* ---------------------------------------------------------------- buffer copies */

/* Plain heap copies of a rank's buffers (no guards), e.g. the reference's expected
 * destination. */
typedef struct kvt_copy {
    uint32_t num_bufs;
    uint8_t **data;
    uint64_t *len;
} kvt_copy_t;

/* Copies the current contents of every buffer. Returns KVW_OK or NO_MEMORY. */
kvw_status_t kvt_copy_make(const kvt_rank_t *rank, kvt_copy_t *copy_p);
/* Zero-filled arrays of the same sizes (e.g. write masks). */
kvw_status_t kvt_copy_zeroed(const kvt_rank_t *rank, kvt_copy_t *copy_p);
void kvt_copy_free(kvt_copy_t *copy);

/* Compares a rank's buffers with a copy. Returns 0, or -1 with a message that decodes
 * the first differing byte (buffer, layer, role, page, offset inside the page). */
int kvt_copy_compare(const kvt_rank_t *rank, const kvt_copy_t *copy, const char *what,
                     char *msg, size_t cap);
/* The same between two copies described by one rank's table. */
int kvt_copy_compare2(const kvt_rank_t *rank, const kvt_copy_t *a, const kvt_copy_t *b,
                      const char *what, char *msg, size_t cap);

/* ---------------------------------------------------------------- page tables */

/* `count` distinct pages out of [0, pool_pages), in random order. Returns 0, or -1 if
 * count > pool_pages or memory runs out. */
int kvt_pages_random(kvt_rng_t *rng, uint32_t pool_pages, uint32_t count, uint32_t *out);

/* start, start + 1, ... */
void kvt_pages_consecutive(uint32_t start, uint32_t count, uint32_t *out);

/* The page lists of one request on one side, owned by this struct. */
typedef struct kvt_req_pages {
    kvw_side_pages_t side;
    uint32_t *full, *swa;
} kvt_req_pages_t;

typedef struct kvt_req_spec {
    uint64_t full_begin, full_end; /* tokens the full pool must cover ([0, n) normally) */
    uint64_t swa_begin, swa_end;   /* tokens the SWA pool must cover (begin floored) */
    int64_t state_slot;            /* -1: none */
    int consecutive;               /* pages start, start+1, ... instead of random */
    uint32_t full_start, swa_start; /* first page when consecutive */
} kvt_req_spec_t;

/*
 * Page lists for a request on `rank`: the begin of each range is floored to the
 * rank's page size (that becomes first_token) and enough pages follow to cover the end.
 * Random pages are distinct within each pool. Returns 0 or -1 (pool too small).
 */
int kvt_req_pages_make(const kvt_rank_t *rank, const kvt_req_spec_t *spec, kvt_rng_t *rng,
                       kvt_req_pages_t *pages_p);
void kvt_req_pages_free(kvt_req_pages_t *pages);

/* ---------------------------------------------------------------- naive reference */

/* One rank as the reference sees it: buffer descriptions, pages and the bytes. */
typedef struct kvt_ref_side {
    const kvw_parallel_t *par;
    const kvw_buffer_desc_t *bufs;
    uint32_t num_bufs;
    const kvw_side_pages_t *pages;
    uint8_t *const *data; /* per buffer: bytes to read (source) or to write (destination) */
} kvt_ref_side_t;

/*
 * Copies, one (token, head) slice at a time, everything destination rank `dst` must
 * receive for `chunk` from the source instance (all its ranks in `srcs`, any order)
 * into dst->data. For each (layer, buffer plane, head) the source rank is chosen by
 * the ownership rule of DESIGN.md section 3 among the ranks whose layer range holds the
 * layer. Tokens follow the kvw_chunk_t comment in kvwire.h.
 *
 * `written` (optional, per destination buffer, same sizes) gets 1 at every byte
 * written; `bytes_per_src` (optional, num_srcs entries) is incremented by the bytes each
 * source supplies. Returns 0, or -1 with a message when the configuration cannot be
 * served (a test bug, not a library bug): no source holds a layer, pages too short...
 */
int kvt_ref_transfer(const kvw_model_t *model, const kvt_ref_side_t *srcs, uint32_t num_srcs,
                     const kvt_ref_side_t *dst, const kvw_chunk_t *chunk, uint8_t *const *written,
                     uint64_t *bytes_per_src, char *msg, size_t cap);

/* Convenience: a reference side for a kvt_rank_t, reading/writing `data` (one pointer
 * per buffer, e.g. a kvt_copy_t's data or the rank's own buffers). */
kvt_ref_side_t kvt_ref_side(const kvt_rank_t *rank, const kvw_side_pages_t *pages,
                            uint8_t *const *data);

/* ---------------------------------------------------------------- small helpers */

/* Layers [begin, end) of PP stage `stage` when `num_layers` are split by `splits`
 * (stage sizes, NULL = as even as possible, earlier stages larger). */
void kvt_pp_range(uint32_t num_layers, uint32_t pp_size, const uint32_t *splits, uint32_t stage,
                  uint32_t *begin, uint32_t *end);

/* Case-insensitive substring test, for checking kvw_last_error() messages. */
int kvt_contains(const char *haystack, const char *needle);

/*
 * An operation or a room that must have failed: `got` is a failure status (neither OK
 * nor INPROGRESS), equal to `want` unless want is KVW_OK (any failure), `reason` is not
 * empty and holds `needle` (case-insensitive; NULL: any reason). Returns 0, or -1 with
 * a message that starts with `what`.
 */
int kvt_expect_failure(const char *what, kvw_status_t got, kvw_status_t want,
                       const char *reason, const char *needle, char *msg, size_t cap);

/* Monotonic time in nanoseconds. */
uint64_t kvt_now_ns(void);

/* ---------------------------------------------------------------- processes */

/* write(2) / read(2) until `len` bytes moved (EINTR retried). Return 0, or -1 on an
 * error or end of file. */
int kvt_write_full(int fd, const void *buf, size_t len);
int kvt_read_full(int fd, void *buf, size_t len);

/* Whether CUDA works here (kvw_cuda_available), asked in a child process, so that this
 * process holds no CUDA state before it forks its own children. 1 or 0. */
int kvt_cuda_probe(void);
/* The same; when it fails, the library's reason in why (cap bytes; may be empty). */
int kvt_cuda_probe_why(char *why, size_t cap);

/* ---------------------------------------------------------------- GPU copies */

/*
 * GPU memory: every buffer of ranks[0 .. n) (with its guard bytes) gets a device copy on
 * `device` (through kvt_cuda_*, below), and each rank is described again with the device
 * addresses; the host copies stay, for the reference and for checking. *dev_p gets, per
 * rank and per buffer, the device allocation; free it with kvt_gpu_free, after a
 * failure too. Returns 0, or -1 with the reason in msg.
 */
int kvt_gpu_attach(kvt_rank_t *ranks, uint32_t n, int device, uint8_t ****dev_p, char *msg,
                   size_t cap);

/* Copies the device bytes (guards included) back into the ranks' host buffers. Returns
 * 0, or -1 with the reason in msg. */
int kvt_gpu_pull(kvt_rank_t *ranks, uint32_t n, uint8_t ***dev, char *msg, size_t cap);

/* Frees what kvt_gpu_attach allocated (dev may be NULL or partly filled). */
void kvt_gpu_free(const kvt_rank_t *ranks, uint32_t n, uint8_t ***dev);

/* ---------------------------------------------------------------- CUDA runtime */

/*
 * The CUDA runtime calls the tools and tests make around the library: device
 * selection, device memory, copies, streams and IPC handles. libkvwire does not export
 * them (engines bring their own CUDA runtime; see kvwire/cuda.h), so the kit loads the
 * library's CUDA module itself, by the library's rule (KVW_CUDA_MODULE, else the module
 * next to libkvwire or the executable it is linked into; src/cuda/module_load.h), and
 * calls the module's operations. With the CPU stand-in module of tests/gpu/ "device
 * memory" is host memory, so CI without a GPU runs the same code.
 *
 * Each returns the module's status (KVW_ERR_UNSUPPORTED when the module cannot be
 * loaded); on failure kvt_cuda_error() says why, for the calling thread. Streams are
 * cudaStream_t values as void *, NULL the legacy default stream; a copy or memset with
 * stream NULL returns when done. Device memory is allocated on the thread's current
 * device; an IPC handle is exported from the start of an allocation.
 */
const char *kvt_cuda_error(void);
kvw_status_t kvt_cuda_set_device(int device);
kvw_status_t kvt_cuda_malloc(uint64_t size, void **ptr_p);
/* Page-locked host memory (cudaMallocHost / cudaFreeHost). */
kvw_status_t kvt_cuda_malloc_host(uint64_t size, void **ptr_p);
kvw_status_t kvt_cuda_free_host(void *ptr);
kvw_status_t kvt_cuda_free(void *ptr);
kvw_status_t kvt_cuda_memcpy(void *dst, const void *src, uint64_t size, void *stream);
kvw_status_t kvt_cuda_memset(void *ptr, int value, uint64_t size, void *stream);
kvw_status_t kvt_cuda_stream_create(void **stream_p);
kvw_status_t kvt_cuda_stream_destroy(void *stream);
kvw_status_t kvt_cuda_stream_sync(void *stream);

#define KVT_CUDA_IPC_HANDLE_SIZE 64
/* Plain bytes, so that a handle can travel in any message. */
typedef struct kvt_cuda_ipc_handle {
    uint8_t bytes[KVT_CUDA_IPC_HANDLE_SIZE];
} kvt_cuda_ipc_handle_t;
kvw_status_t kvt_cuda_ipc_export(void *base, kvt_cuda_ipc_handle_t *handle_p);
/* Maps a peer's allocation into the current device's context (peer access enabled as
 * needed); valid until kvt_cuda_ipc_close. */
kvw_status_t kvt_cuda_ipc_open(const kvt_cuda_ipc_handle_t *handle, void **ptr_p);
kvw_status_t kvt_cuda_ipc_close(void *ptr);

#ifdef __cplusplus
}
#endif

#endif
