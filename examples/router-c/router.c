/*
 * router-c's logic: JSON decoding of route values, the query response, and the routing table.
 *
 * The semantics are the Rust router's (guests/router/src/lib.rs), byte for byte, because a host
 * may run either guest over the same bucket and the tests hold both to the same answers. Where the
 * Rust guest leans on a library (serde_json, String::from_utf8_lossy), the behaviour reproduced
 * here is that library's, and the comments say which.
 *
 * Every input byte sequence is handled without a trap: all reads are bounds-checked indices into
 * (pointer, length) slices, all size arithmetic is checked for overflow, and only a failed malloc
 * is reported upwards (guest.c turns that into an error or, where the WIT leaves no error channel,
 * a trap — as a Rust guest aborts when allocation fails).
 */
#include "router.h"

#include <stdlib.h>
#include <string.h>

/* ---- UTF-8 ---------------------------------------------------------------------------------- */

/*
 * The length (1..4) of the well-formed UTF-8 sequence at s[i], or 0 when it is ill-formed; then
 * *bad is the length (1..3) of its maximal ill-formed prefix: the lead byte and the continuation
 * bytes that were still acceptable. This is the Unicode "maximal subpart" rule that Rust's
 * Utf8Chunks (behind from_utf8_lossy) follows, and it rejects overlong forms, surrogates and code
 * points past U+10FFFF as Rust's str::from_utf8 does. Requires i < n.
 */
static size_t utf8_sequence(const uint8_t *s, size_t n, size_t i, size_t *bad)
{
    uint8_t lead = s[i];
    size_t need;
    /* The range of the first continuation byte depends on the lead byte (Unicode table 3-7). */
    uint8_t lo = 0x80, hi = 0xBF;

    if (lead < 0x80)
        return 1;
    if (lead >= 0xC2 && lead <= 0xDF) {
        need = 1;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
        need = 2;
        if (lead == 0xE0)
            lo = 0xA0; /* no overlong 3-byte forms */
        else if (lead == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (lead >= 0xF0 && lead <= 0xF4) {
        need = 3;
        if (lead == 0xF0)
            lo = 0x90; /* no overlong 4-byte forms */
        else if (lead == 0xF4)
            hi = 0x8F; /* nothing past U+10FFFF */
    } else {
        *bad = 1;
        return 0;
    }
    for (size_t k = 1; k <= need; k++) {
        if (n - i <= k || s[i + k] < lo || s[i + k] > hi) {
            *bad = k;
            return 0;
        }
        lo = 0x80;
        hi = 0xBF;
    }
    return need + 1;
}

static const uint8_t REPLACEMENT[3] = {0xEF, 0xBF, 0xBD}; /* U+FFFD */

uint8_t *utf8_lossy(const char *prefix, const uint8_t *bytes, size_t len, size_t *out_len)
{
    size_t plen = strlen(prefix);
    /* A replacement (3 bytes) stands for at least one input byte: 3 * len bounds the text. */
    if (len > (SIZE_MAX - plen) / 3)
        return NULL;
    uint8_t *out = malloc(plen + 3 * len + 1); /* + 1: never malloc(0) */
    if (out == NULL)
        return NULL;
    memcpy(out, prefix, plen);
    size_t o = plen;
    for (size_t i = 0; i < len;) {
        size_t bad = 0;
        size_t seq = utf8_sequence(bytes, len, i, &bad);
        if (seq > 0) {
            memcpy(out + o, bytes + i, seq);
            o += seq;
            i += seq;
        } else {
            memcpy(out + o, REPLACEMENT, sizeof REPLACEMENT);
            o += sizeof REPLACEMENT;
            i += bad;
        }
    }
    *out_len = o;
    return out;
}

/* ---- JSON decoding ------------------------------------------------------------------------- */

/*
 * A read position in the value. Every access goes through peek/at_end, so no read passes the end.
 */
struct cursor {
    const uint8_t *s;
    size_t n;
    size_t i;
};

/* The next byte, or -1 at the end. */
static int peek(const struct cursor *c)
{
    return c->i < c->n ? c->s[c->i] : -1;
}

/* JSON's four whitespace bytes, as serde_json skips them. */
static void skip_ws(struct cursor *c)
{
    while (c->i < c->n) {
        uint8_t b = c->s[c->i];
        if (b != ' ' && b != '\n' && b != '\t' && b != '\r')
            return;
        c->i++;
    }
}

/* Consumes `b` if it is next. */
static bool eat(struct cursor *c, int b)
{
    if (peek(c) != b)
        return false;
    c->i++;
    return true;
}

static int hex_digit(int b)
{
    if (b >= '0' && b <= '9')
        return b - '0';
    if (b >= 'a' && b <= 'f')
        return b - 'a' + 10;
    if (b >= 'A' && b <= 'F')
        return b - 'A' + 10;
    return -1;
}

/* The four hex digits after `\u` (upper or lower case), or -1. */
static long hex4(struct cursor *c)
{
    long v = 0;
    for (int k = 0; k < 4; k++) {
        int d = hex_digit(peek(c));
        if (d < 0)
            return -1;
        c->i++;
        v = v * 16 + d;
    }
    return v;
}

/* Encodes code point cp as UTF-8 (cp is a scalar value: no surrogates, at most U+10FFFF). */
static size_t put_utf8(uint32_t cp, uint8_t out[4])
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/*
 * Reads a JSON string's body (the cursor is just past the opening quote) up to and past the
 * closing quote. Returns false when serde_json would refuse it.
 *
 * strict (what serde_json's parse_str does for a value it decodes: keys of the route object and
 * the upstream): raw bytes must be well-formed UTF-8, and a \u escape of a surrogate must be a
 * high surrogate followed by `\u` and a low one. Not strict (its ignore_str, for values the
 * router ignores): any raw bytes but control characters, and \u takes any four hex digits.
 * Control characters U+0000..U+001F are refused raw in both.
 *
 * Strict, the decoded text's length goes to *decoded_len and its first `cap` bytes to out when out
 * is not NULL (the rest are counted, not written); not strict, nothing is decoded. Raw runs can be checked one sequence at a time because
 * an escape always decodes to whole UTF-8 sequences, so it can neither complete nor continue a raw
 * one: checking the whole decoded text, as serde_json does, gives the same answer.
 */
static bool read_string(struct cursor *c, bool strict, uint8_t *out, size_t cap,
                        size_t *decoded_len)
{
    size_t len = 0;
    for (;;) {
        int b = peek(c);
        uint8_t buf[4];
        size_t k;
        if (b < 0)
            return false; /* end of input inside the string */
        if (b == '"') {
            c->i++;
            *decoded_len = len;
            return true;
        }
        if (b < 0x20)
            return false;
        if (b != '\\') {
            size_t bad;
            size_t seq = strict ? utf8_sequence(c->s, c->n, c->i, &bad) : 1;
            if (seq == 0)
                return false;
            for (k = 0; k < seq; k++) {
                if (out != NULL && len < cap)
                    out[len] = c->s[c->i];
                len++;
                c->i++;
            }
            continue;
        }
        c->i++; /* the backslash */
        b = peek(c);
        if (b < 0)
            return false;
        c->i++; /* the escape letter */
        switch (b) {
        case '"': case '\\': case '/': buf[0] = (uint8_t)b; k = 1; break;
        case 'b': buf[0] = '\b'; k = 1; break;
        case 'f': buf[0] = '\f'; k = 1; break;
        case 'n': buf[0] = '\n'; k = 1; break;
        case 'r': buf[0] = '\r'; k = 1; break;
        case 't': buf[0] = '\t'; k = 1; break;
        case 'u': {
            long u = hex4(c);
            if (u < 0)
                return false;
            if (!strict) {
                /* ignore_str: the code point is not checked; nothing is decoded anyway. */
                k = 0;
                break;
            }
            if (u >= 0xDC00 && u <= 0xDFFF)
                return false; /* a low surrogate first */
            if (u >= 0xD800 && u <= 0xDBFF) {
                if (!eat(c, '\\') || !eat(c, 'u'))
                    return false;
                long low = hex4(c);
                if (low < 0xDC00 || low > 0xDFFF)
                    return false;
                u = 0x10000 + ((u - 0xD800) << 10) + (low - 0xDC00);
            }
            k = put_utf8((uint32_t)u, buf);
            break;
        }
        default:
            return false; /* not one of JSON's escapes */
        }
        for (size_t j = 0; j < k; j++) {
            if (out != NULL && len < cap)
                out[len] = buf[j];
            len++;
        }
    }
}

/*
 * A stack of one bit per open bracket ('[' = 0, '{' = 1), for skipping a value without recursion:
 * serde_json's ignore_value has no nesting limit, so neither may this. The first 4096 levels need
 * no allocation; deeper ones grow a heap copy, bounded by the value's length.
 */
struct bit_stack {
    uint8_t local[512];
    uint8_t *bits;
    size_t capacity; /* in bytes */
    size_t depth;
};

static bool bits_push(struct bit_stack *st, bool brace)
{
    if (st->depth / 8 >= st->capacity) {
        if (st->capacity > SIZE_MAX / 2)
            return false;
        size_t cap = st->capacity * 2;
        uint8_t *grown = malloc(cap);
        if (grown == NULL)
            return false;
        memcpy(grown, st->bits, st->capacity);
        if (st->bits != st->local)
            free(st->bits);
        st->bits = grown;
        st->capacity = cap;
    }
    uint8_t mask = (uint8_t)(1u << (st->depth % 8));
    if (brace)
        st->bits[st->depth / 8] |= mask;
    else
        st->bits[st->depth / 8] &= (uint8_t)~mask;
    st->depth++;
    return true;
}

/* The innermost open bracket: '{' or '['. Requires depth > 0. */
static int bits_top(const struct bit_stack *st)
{
    size_t d = st->depth - 1;
    return (st->bits[d / 8] >> (d % 8)) & 1 ? '{' : '[';
}

/* The rest of a literal (after its first letter). */
static bool eat_word(struct cursor *c, const char *rest)
{
    for (; *rest != '\0'; rest++)
        if (!eat(c, (unsigned char)*rest))
            return false;
    return true;
}

static bool eat_digits(struct cursor *c)
{
    bool any = false;
    while (peek(c) >= '0' && peek(c) <= '9') {
        c->i++;
        any = true;
    }
    return any;
}

/*
 * A JSON number without its '-', as serde_json's ignore_integer reads it: no leading zeros, a
 * fraction and an exponent each need a digit. Its size is not checked (it is ignored).
 */
static bool skip_number(struct cursor *c)
{
    if (eat(c, '0')) {
        if (peek(c) >= '0' && peek(c) <= '9')
            return false;
    } else if (!eat_digits(c)) {
        return false;
    }
    if (eat(c, '.') && !eat_digits(c))
        return false;
    if (eat(c, 'e') || eat(c, 'E')) {
        if (!eat(c, '+'))
            eat(c, '-');
        if (!eat_digits(c))
            return false;
    }
    return true;
}

enum skip { SKIPPED, INVALID, NO_MEMORY };

/*
 * Skips one JSON value the router ignores (the value of a key other than "upstream"), following
 * serde_json's ignore_value: iterative, so any nesting depth is fine; strings checked leniently.
 */
static enum skip skip_value(struct cursor *c)
{
    struct bit_stack st;
    st.bits = st.local;
    st.capacity = sizeof st.local;
    st.depth = 0;
    enum skip result = INVALID;

    for (;;) {
        size_t ignored;
        bool opened = false;
        skip_ws(c);
        int b = peek(c);
        if (b < 0)
            goto done; /* the input ended where a value was due */
        if (b >= '0' && b <= '9') {
            if (!skip_number(c)) /* it reads the first digit itself */
                goto done;
        } else {
            c->i++;
            switch (b) {
            case 'n': if (!eat_word(c, "ull")) goto done; break;
            case 't': if (!eat_word(c, "rue")) goto done; break;
            case 'f': if (!eat_word(c, "alse")) goto done; break;
            case '"': if (!read_string(c, false, NULL, 0, &ignored)) goto done; break;
            case '-': if (!skip_number(c)) goto done; break;
            case '[': case '{':
                if (!bits_push(&st, b == '{')) {
                    result = NO_MEMORY;
                    goto done;
                }
                opened = true;
                break;
            default:
                goto done; /* not the start of a value */
            }
        }
        if (st.depth == 0) {
            result = SKIPPED; /* a scalar, at the top */
            goto done;
        }
        /* After a value: a comma, or closers. Right after an opener: a closer, or a member. */
        bool want_comma = !opened;
        for (;;) {
            skip_ws(c);
            int next = peek(c);
            if (next == ',' && want_comma) {
                c->i++;
                break;
            }
            if ((next == ']' && bits_top(&st) == '[') || (next == '}' && bits_top(&st) == '{')) {
                c->i++;
                if (--st.depth == 0) {
                    result = SKIPPED;
                    goto done;
                }
                want_comma = true;
                continue;
            }
            if (next < 0 || want_comma)
                goto done;
            break; /* the first member of a container just opened */
        }
        if (bits_top(&st) == '{') {
            skip_ws(c);
            if (!eat(c, '"') || !read_string(c, false, NULL, 0, &ignored))
                goto done;
            skip_ws(c);
            if (!eat(c, ':'))
                goto done;
        }
    }
done:
    if (st.bits != st.local)
        free(st.bits);
    return result;
}

/* A strict string value where the cursor is (after whitespace): its start and decoded length. */
static bool read_string_value(struct cursor *c, size_t *start, size_t *decoded_len)
{
    skip_ws(c);
    if (!eat(c, '"'))
        return false;
    *start = c->i;
    return read_string(c, true, NULL, 0, decoded_len);
}

enum json_result json_find_upstream(const uint8_t *json, size_t len, size_t *str_start,
                                    size_t *decoded_len)
{
    struct cursor c = {json, len, 0};
    skip_ws(&c);
    if (eat(&c, '[')) {
        /* serde's derived visit_seq: exactly one element, the upstream string. */
        skip_ws(&c);
        if (peek(&c) == ']')
            return JSON_NOT_A_ROUTE;
        if (!read_string_value(&c, str_start, decoded_len))
            return JSON_NOT_A_ROUTE;
        skip_ws(&c);
        if (!eat(&c, ']'))
            return JSON_NOT_A_ROUTE;
    } else if (eat(&c, '{')) {
        bool found = false;
        for (bool first = true;; first = false) {
            skip_ws(&c);
            if (eat(&c, '}'))
                break;
            if (!first) {
                if (!eat(&c, ','))
                    return JSON_NOT_A_ROUTE;
                skip_ws(&c);
            }
            /* Keys are decoded (escapes too) before serde compares them to "upstream"; a key is
             * that field exactly when its text is 8 bytes long and equal. */
            uint8_t key[8];
            size_t key_len;
            if (!eat(&c, '"') || !read_string(&c, true, key, sizeof key, &key_len))
                return JSON_NOT_A_ROUTE;
            skip_ws(&c);
            if (!eat(&c, ':'))
                return JSON_NOT_A_ROUTE;
            if (key_len == sizeof key && memcmp(key, "upstream", sizeof key) == 0) {
                if (found)
                    return JSON_NOT_A_ROUTE; /* serde: duplicate field */
                if (!read_string_value(&c, str_start, decoded_len))
                    return JSON_NOT_A_ROUTE;
                found = true;
            } else {
                switch (skip_value(&c)) {
                case SKIPPED: break;
                case INVALID: return JSON_NOT_A_ROUTE;
                case NO_MEMORY: return JSON_NO_MEMORY;
                }
            }
        }
        if (!found)
            return JSON_NOT_A_ROUTE; /* serde: missing field */
    } else {
        return JSON_NOT_A_ROUTE;
    }
    skip_ws(&c);
    return c.i == c.n ? JSON_ROUTE : JSON_NOT_A_ROUTE; /* serde_json: trailing characters */
}

void json_decode_string(const uint8_t *json, size_t len, size_t str_start, uint8_t *out)
{
    struct cursor c = {json, len, str_start};
    size_t decoded_len;
    /* The string was read once already, so this cannot fail; out holds decoded_len bytes. */
    (void)read_string(&c, true, out, SIZE_MAX, &decoded_len);
}

/* ---- JSON encoding ------------------------------------------------------------------------- */

static const char HEX[] = "0123456789abcdef"; /* serde_json writes \u00xx in lower case */

/* The escape serde_json writes for byte b: 0 none, 'u' for \u00xx, else the letter after `\`. */
static char escape_of(uint8_t b)
{
    switch (b) {
    case '"': return '"';
    case '\\': return '\\';
    case '\b': return 'b';
    case '\t': return 't';
    case '\n': return 'n';
    case '\f': return 'f';
    case '\r': return 'r';
    default: return b < 0x20 ? 'u' : 0;
    }
}

uint8_t *json_route_response(const uint8_t *upstream, size_t len, size_t *out_len)
{
    static const char head[] = "{\"upstream\":\"";
    static const char tail[] = "\"}";
    const size_t frame = sizeof head - 1 + sizeof tail - 1;
    /* Each byte needs at most 6 (\u00xx). */
    if (len > (SIZE_MAX - frame) / 6)
        return NULL;
    uint8_t *out = malloc(frame + 6 * len);
    if (out == NULL)
        return NULL;
    size_t o = 0;
    memcpy(out, head, sizeof head - 1);
    o += sizeof head - 1;
    for (size_t i = 0; i < len; i++) {
        uint8_t b = upstream[i];
        char e = escape_of(b);
        if (e == 0) {
            out[o++] = b;
        } else if (e != 'u') {
            out[o++] = '\\';
            out[o++] = (uint8_t)e;
        } else {
            memcpy(out + o, "\\u00", 4);
            o += 4;
            out[o++] = (uint8_t)HEX[b >> 4];
            out[o++] = (uint8_t)HEX[b & 0xF];
        }
    }
    memcpy(out + o, tail, sizeof tail - 1);
    o += sizeof tail - 1;
    *out_len = o;
    return out;
}

/* ---- The routing table --------------------------------------------------------------------- */

/*
 * FNV-1a, 32 bits. Keys come from the operator's bucket, not from strangers, and the guest has no
 * randomness to seed a keyed hash with (no WASI), so a plain hash is the honest choice.
 */
static uint32_t hash_bytes(const uint8_t *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 16777619u;
    }
    return h;
}

/* The slot holding `host`, or the empty slot where it would go. Requires capacity > 0. */
static size_t find_slot(const struct router *r, const uint8_t *host, size_t len, uint32_t h)
{
    size_t mask = r->capacity - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        const struct route *s = &r->slots[i];
        if (s->bytes == NULL ||
            (s->hash == h && s->host_len == len && memcmp(s->bytes, host, len) == 0))
            return i;
    }
}

/* Makes room for `more` new hosts while keeping at most half the slots used. */
static bool reserve(struct router *r, size_t more)
{
    if (more > SIZE_MAX / 2 - r->len)
        return false;
    size_t want = 2 * (r->len + more);
    if (want <= r->capacity)
        return true;
    size_t cap = r->capacity ? r->capacity : 64;
    while (cap < want) {
        if (cap > SIZE_MAX / 2 / sizeof(struct route))
            return false;
        cap *= 2;
    }
    struct route *slots = calloc(cap, sizeof *slots);
    if (slots == NULL)
        return false;
    struct route *old = r->slots;
    size_t old_cap = r->capacity;
    r->slots = slots;
    r->capacity = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].bytes == NULL)
            continue;
        size_t mask = cap - 1;
        size_t j = old[i].hash & mask;
        while (slots[j].bytes != NULL)
            j = (j + 1) & mask;
        slots[j] = old[i];
    }
    free(old);
    return true;
}

const struct route *router_get(const struct router *r, const uint8_t *host, size_t len)
{
    if (r->len == 0)
        return NULL;
    size_t i = find_slot(r, host, len, hash_bytes(host, len));
    return r->slots[i].bytes != NULL ? &r->slots[i] : NULL;
}

/* Inserts or replaces c's host, taking its bytes. Requires room (reserve). */
static void table_put(struct router *r, struct change *c)
{
    uint32_t h = hash_bytes(c->bytes, c->host_len);
    struct route *s = &r->slots[find_slot(r, c->bytes, c->host_len, h)];
    if (s->bytes != NULL)
        free(s->bytes);
    else
        r->len++;
    s->bytes = c->bytes;
    s->host_len = c->host_len;
    s->upstream_len = c->upstream_len;
    s->hash = h;
    c->bytes = NULL;
}

/*
 * Removes a host. Linear probing cannot just empty the slot (a later key of the same probe run
 * would become unreachable), so the run after it is shifted back over the hole instead of leaving
 * tombstones: lookups stay short however many deletes happen.
 */
static void table_remove(struct router *r, const uint8_t *host, size_t len)
{
    if (r->len == 0)
        return;
    size_t mask = r->capacity - 1;
    size_t hole = find_slot(r, host, len, hash_bytes(host, len));
    if (r->slots[hole].bytes == NULL)
        return;
    free(r->slots[hole].bytes);
    r->len--;
    for (size_t j = (hole + 1) & mask; r->slots[j].bytes != NULL; j = (j + 1) & mask) {
        size_t home = r->slots[j].hash & mask;
        /* The entry at j may fill the hole unless its home lies cyclically in (hole, j]. */
        bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            r->slots[hole] = r->slots[j];
            hole = j;
        }
    }
    r->slots[hole] = (struct route){0};
}

/* ---- The router ---------------------------------------------------------------------------- */

static void drop_pending(struct router *r)
{
    for (size_t i = 0; i < r->pending_len; i++)
        free(r->pending[i].bytes);
    r->pending_len = 0;
}

bool router_begin_batch(struct router *r, size_t updates)
{
    drop_pending(r);
    if (updates <= r->pending_capacity)
        return true;
    if (updates > SIZE_MAX / sizeof(struct change))
        return false;
    struct change *grown = realloc(r->pending, updates * sizeof *grown);
    if (grown == NULL)
        return false;
    r->pending = grown;
    r->pending_capacity = updates;
    return true;
}

enum verdict router_parse(struct router *r, const uint8_t *key, size_t key_len,
                          const uint8_t *value, size_t value_len, bool is_put, bool *ok)
{
    *ok = true;
    if (key_len < ROUTER_PREFIX_LEN || memcmp(key, ROUTER_PREFIX, ROUTER_PREFIX_LEN) != 0)
        return VERDICT_SKIP; /* outside the manifest's scope, as the Rust SDK answers it */
    const uint8_t *host = key + ROUTER_PREFIX_LEN;
    size_t host_len = key_len - ROUTER_PREFIX_LEN;
    size_t start = 0, upstream_len = 0;

    if (is_put) {
        if (host_len == 0)
            return VERDICT_SKIP;
        switch (json_find_upstream(value, value_len, &start, &upstream_len)) {
        case JSON_ROUTE: break;
        case JSON_NOT_A_ROUTE: upstream_len = 0; break; /* no route: removes the host */
        case JSON_NO_MEMORY: *ok = false; return VERDICT_SKIP;
        }
    } else if (host_len == 0) {
        /* Deleting "route." is accepted (in scope) and removes nothing: no empty host is ever
         * stored, so there is nothing to keep for apply. */
        return VERDICT_ACCEPT;
    }
    if (r->pending_len == r->pending_capacity || upstream_len > SIZE_MAX - host_len) {
        *ok = false; /* begin_batch reserved a slot per update; a string can't span the memory */
        return VERDICT_SKIP;
    }
    uint8_t *bytes = malloc(host_len + upstream_len);
    if (bytes == NULL) {
        *ok = false;
        return VERDICT_SKIP;
    }
    memcpy(bytes, host, host_len);
    if (upstream_len > 0)
        json_decode_string(value, value_len, start, bytes + host_len);
    r->pending[r->pending_len++] = (struct change){bytes, host_len, upstream_len};
    return VERDICT_ACCEPT;
}

bool router_apply(struct router *r)
{
    size_t puts = 0;
    for (size_t i = 0; i < r->pending_len; i++)
        puts += r->pending[i].upstream_len > 0;
    /* Growing first means every insert below has room: an apply is all or nothing. */
    if (!reserve(r, puts)) {
        drop_pending(r);
        return false;
    }
    for (size_t i = 0; i < r->pending_len; i++) {
        struct change *c = &r->pending[i];
        if (c->upstream_len > 0) {
            table_put(r, c);
        } else {
            table_remove(r, c->bytes, c->host_len);
            free(c->bytes);
            c->bytes = NULL;
        }
    }
    r->pending_len = 0;
    return true;
}

uint8_t *router_query(const struct router *r, const uint8_t *request, size_t len, size_t *out_len,
                      bool *is_error)
{
    static const char prefix[] = "unknown host: ";
    size_t n;
    /* The error message and the lookup key are the same lossy text, so it is made once. */
    uint8_t *message = utf8_lossy(prefix, request, len, &n);
    if (message == NULL)
        return NULL;
    const uint8_t *host = message + (sizeof prefix - 1);
    const struct route *route = router_get(r, host, n - (sizeof prefix - 1));
    if (route == NULL) {
        *is_error = true;
        *out_len = n;
        return message;
    }
    free(message);
    *is_error = false;
    return json_route_response(route->bytes + route->host_len, route->upstream_len, out_len);
}

void router_free(struct router *r)
{
    drop_pending(r);
    free(r->pending);
    for (size_t i = 0; i < r->capacity; i++)
        free(r->slots[i].bytes);
    free(r->slots);
    *r = (struct router)ROUTER_INIT;
}
