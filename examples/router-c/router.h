/*
 * router-c: the routing table of the Rust `router` guest (guests/router/src/lib.rs), in C.
 *
 * This header is the guest's logic without the component bindings: plain C on byte slices, so the
 * same code is compiled for wasm32-wasi (with guest.c, the glue to the generated bindings) and
 * natively for test_native.c. Nothing here assumes NUL-terminated strings: keys, values and
 * upstreams are (pointer, length) pairs and may contain any byte, NUL included.
 */
#ifndef ROUTER_C_ROUTER_H
#define ROUTER_C_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The keys this guest folds, and the manifest's only scope prefix. */
#define ROUTER_PREFIX "route."
#define ROUTER_PREFIX_LEN (sizeof ROUTER_PREFIX - 1)

/* ---- JSON: a route value -------------------------------------------------------------------- */

enum json_result {
    JSON_ROUTE,        /* a route: *str_start and *decoded_len name its "upstream" string */
    JSON_NOT_A_ROUTE,  /* anything serde_json would refuse to decode as the Rust router's Route */
    JSON_NO_MEMORY,    /* skipping a deeply nested value needed memory that malloc refused */
};

/*
 * Decides whether `json` decodes as the Rust router's `Route { upstream: String }` under
 * serde_json::from_slice, exactly: one JSON object with exactly one "upstream" key (escapes in keys
 * decoded) whose value is a string, any other keys with any valid JSON values, only whitespace
 * around it. Like serde's derived Deserialize, the one-element array form `["<addr>"]` is a route
 * too. On JSON_ROUTE, *str_start is the index of the upstream's first byte after its opening quote
 * and *decoded_len the length of its decoded (UTF-8) text; the text may be empty.
 */
enum json_result json_find_upstream(const uint8_t *json, size_t len, size_t *str_start,
                                    size_t *decoded_len);

/*
 * Writes the decoded text of the string json_find_upstream accepted (starting at str_start) into
 * out, which holds the decoded_len bytes it reported.
 */
void json_decode_string(const uint8_t *json, size_t len, size_t str_start, uint8_t *out);

/*
 * The response to a query, as serde_json::to_vec(&Route { upstream }) writes it:
 * {"upstream":"<text>"} with `"`, `\` and the control characters U+0000..U+001F escaped (\b \t \n
 * \f \r, else \u00xx in lower-case hex). Returns the malloc'd bytes and their length in *out_len,
 * or NULL when the length overflows or malloc fails.
 */
uint8_t *json_route_response(const uint8_t *upstream, size_t len, size_t *out_len);

/* ---- UTF-8 ---------------------------------------------------------------------------------- */

/*
 * `prefix` followed by `bytes` made valid UTF-8 the way Rust's String::from_utf8_lossy does it:
 * each maximal ill-formed subsequence becomes one U+FFFD. Malloc'd; NULL when the length overflows
 * or malloc fails.
 */
uint8_t *utf8_lossy(const char *prefix, const uint8_t *bytes, size_t len, size_t *out_len);

/* ---- The router ----------------------------------------------------------------------------- */

/* One host's route, in one allocation: the host's bytes, then the upstream's. */
struct route {
    uint8_t *bytes;      /* NULL: an empty slot */
    size_t host_len;
    size_t upstream_len;
    uint32_t hash;       /* of the host, kept so that growing never rehashes bytes */
};

/* A change `parse` accepted, waiting for `apply`: upstream_len 0 removes the host. */
struct change {
    uint8_t *bytes;      /* host, then upstream; owned until apply */
    size_t host_len;
    size_t upstream_len;
};

struct router {
    /* Open addressing with linear probing; the capacity is a power of two (or 0) and at most
     * half the slots are used, so every probe ends at an empty slot. */
    struct route *slots;
    size_t capacity;
    size_t len;
    /* What the last parse accepted, in order. Its capacity is the largest batch seen, which the
     * host bounds (--batch-max). */
    struct change *pending;
    size_t pending_len;
    size_t pending_capacity;
};

enum verdict { VERDICT_ACCEPT, VERDICT_SKIP };

/* An empty router: all fields zero. */
#define ROUTER_INIT {0}

/*
 * Starts a batch of `updates` updates: drops whatever the previous parse left unapplied and
 * reserves room for the batch. False when malloc fails.
 */
bool router_begin_batch(struct router *r, size_t updates);

/*
 * Parses one update of the batch (is_put false: a delete or a purge), keeping what it accepts.
 * Out-of-scope keys and puts of an empty host are skipped; every other update is accepted: a put
 * whose value is no route (or an empty upstream) removes the host, as a delete does. False in
 * *ok when malloc fails (the verdict is then meaningless).
 */
enum verdict router_parse(struct router *r, const uint8_t *key, size_t key_len,
                          const uint8_t *value, size_t value_len, bool is_put, bool *ok);

/*
 * Applies, in order, what the last parse accepted, and forgets it. False when the table could not
 * grow (malloc): then nothing was applied, and the pending changes are dropped all the same.
 */
bool router_apply(struct router *r);

/* The route of `host` (exact bytes), or NULL. */
const struct route *router_get(const struct router *r, const uint8_t *host, size_t len);

/*
 * Answers a query whose request is a host name: the request is read as Rust's
 * String::from_utf8_lossy reads it, then looked up. Sets *is_error and returns the malloc'd answer:
 * the JSON response, or the error `unknown host: <name>` (valid UTF-8). NULL when malloc fails.
 */
uint8_t *router_query(const struct router *r, const uint8_t *request, size_t len, size_t *out_len,
                      bool *is_error);

/* Frees everything; leaves an empty router. */
void router_free(struct router *r);

#endif
