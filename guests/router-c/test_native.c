/*
 * Native unit tests of router-c's logic (router.c), compiled with the machine's C compiler:
 * `guests/router-c/build.sh test`. They mirror the Rust router's own tests
 * (guests/router/src/lib.rs) and pin the serde_json behaviours router.c reproduces.
 */
#include "router.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed, failed;

#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (cond) {                                                                              \
            passed++;                                                                            \
        } else {                                                                                 \
            failed++;                                                                            \
            fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond);                    \
            fprintf(stderr, __VA_ARGS__);                                                        \
            fputc('\n', stderr);                                                                 \
        }                                                                                        \
    } while (0)

/* What router.c makes of a value: the upstream it would route to (malloc'd, NUL added for
 * printing), or NULL for "no route" (including an empty upstream, as the router treats it). */
static char *upstream_of(const uint8_t *json, size_t len, size_t *out_len)
{
    size_t start, n;
    if (json_find_upstream(json, len, &start, &n) != JSON_ROUTE)
        return NULL;
    char *out = malloc(n + 1);
    if (out == NULL)
        abort();
    json_decode_string(json, len, start, (uint8_t *)out);
    out[n] = '\0';
    *out_len = n;
    return out;
}

/* A value given as a C string decodes to `want` (NULL: not a route). */
static void json_case(const char *json, const char *want, size_t want_len, int line)
{
    size_t n = 0;
    char *got = upstream_of((const uint8_t *)json, strlen(json), &n);
    if (want == NULL)
        CHECK(got == NULL, "line %d: %s should be no route, got \"%s\"", line, json,
              got ? got : "");
    else
        CHECK(got != NULL && n == want_len && memcmp(got, want, n) == 0,
              "line %d: %s should route to \"%s\", got %s", line, json, want,
              got ? got : "no route");
    free(got);
}
#define ROUTE(json, want) json_case(json, want, sizeof(want) - 1, __LINE__)
#define NO_ROUTE(json) json_case(json, NULL, 0, __LINE__)

static void test_json(void)
{
    /* The Rust router's parse_routes cases. */
    ROUTE("{\"upstream\": \"10.0.0.1:80\", \"extra\": 1}", "10.0.0.1:80");
    NO_ROUTE("not json");
    NO_ROUTE("{}");
    NO_ROUTE("{\"upstream\": 7}");
    ROUTE("{\"upstream\": \"\"}", ""); /* decodes; the router then treats it as no route */
    NO_ROUTE("");

    /* Whitespace, key order, other members of every kind (skipped like serde_json's IgnoredAny). */
    ROUTE(" \t\r\n{ \"a\" : [1, -2.5e+3, 0, 0.0, 1E9, true, false, null, {}, [], {\"b\": [\"c\"]}],"
          " \"upstream\" : \"x\" } \n", "x");
    ROUTE("{\"upstream\":\"x\",\"z\":{\"y\":{\"x\":[[[]]]}}}", "x");
    ROUTE("{\"skip\":\"\\ud800 lone surrogate and \xff bad UTF-8 are fine when ignored\","
          "\"upstream\":\"x\"}", "x");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":[1,]}");   /* trailing comma in an ignored array */
    NO_ROUTE("{\"upstream\":\"x\",\"a\":{\"b\":1,}}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":01}");     /* leading zero */
    NO_ROUTE("{\"upstream\":\"x\",\"a\":1.}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":1e}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":-}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":+1}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":tru}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":[1 2]}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":{1:2}}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":[}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":\"\\x\"}"); /* unknown escape, even when ignored */
    NO_ROUTE("{\"upstream\":\"x\",\"a\":\"\\u12\"}");
    NO_ROUTE("{\"upstream\":\"x\",\"a\":\"tab\there\"}"); /* raw control character */
    NO_ROUTE("{\"upstream\":\"x\",\"a\":}");

    /* The object itself. */
    NO_ROUTE("{\"upstream\":\"x\",}");
    NO_ROUTE("{,\"upstream\":\"x\"}");
    NO_ROUTE("{\"upstream\":\"x\" \"a\":1}");
    NO_ROUTE("{\"upstream\" \"x\"}");
    NO_ROUTE("{\"upstream\":\"x\"");
    NO_ROUTE("{\"upstream\":\"x\"}}");
    NO_ROUTE("{\"upstream\":\"x\"} x");
    NO_ROUTE("{\"upstream\":\"a\",\"upstream\":\"b\"}"); /* serde: duplicate field */
    NO_ROUTE("{\"upstream\":null}");
    NO_ROUTE("{\"upstream\":[\"x\"]}");
    NO_ROUTE("{\"Upstream\":\"x\"}");
    NO_ROUTE("{\"upstream \":\"x\"}");
    NO_ROUTE("\"x\"");
    NO_ROUTE("null");
    ROUTE("{\"upstr\\u0065am\":\"x\"}", "x"); /* keys are compared decoded */
    NO_ROUTE("{\"upstream\":\"a\",\"upstr\\u0065am\":\"b\"}");
    NO_ROUTE("{\"k\\ud800\":1,\"upstream\":\"x\"}"); /* route keys are decoded strictly */
    NO_ROUTE("{\"k\xff\":1,\"upstream\":\"x\"}");

    /* serde's derived Deserialize also takes a struct as a sequence of its fields. */
    ROUTE("[\"10.0.0.1:80\"]", "10.0.0.1:80");
    ROUTE(" [ \"x\" ] ", "x");
    NO_ROUTE("[]");
    NO_ROUTE("[\"x\",]");
    NO_ROUTE("[\"x\",1]");
    NO_ROUTE("[1]");

    /* The upstream string, decoded strictly. */
    ROUTE("{\"upstream\":\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"}", "\"\\/\b\f\n\r\t");
    ROUTE("{\"upstream\":\"\\u0041\\u00e9\\u20AC\\ud83d\\ude00\"}",
          "A\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
    ROUTE("{\"upstream\":\"a\\u0000b\"}", "a\0b");
    ROUTE("{\"upstream\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x7f\"}",
          "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x7f");
    NO_ROUTE("{\"upstream\":\"\\ud83d\"}");         /* lone high surrogate */
    NO_ROUTE("{\"upstream\":\"\\ud83dx\"}");
    NO_ROUTE("{\"upstream\":\"\\ud83d\\n\"}");
    NO_ROUTE("{\"upstream\":\"\\ud83d\\u0041\"}");
    NO_ROUTE("{\"upstream\":\"\\ude00\"}");         /* lone low surrogate */
    NO_ROUTE("{\"upstream\":\"\\u00g0\"}");
    NO_ROUTE("{\"upstream\":\"\\u00\"}");
    NO_ROUTE("{\"upstream\":\"\\\"}");
    NO_ROUTE("{\"upstream\":\"\\");
    NO_ROUTE("{\"upstream\":\"\\a\"}");
    NO_ROUTE("{\"upstream\":\"\xff\"}");             /* not UTF-8 */
    NO_ROUTE("{\"upstream\":\"\xc0\xaf\"}");         /* overlong */
    NO_ROUTE("{\"upstream\":\"\xed\xa0\x80\"}");     /* an encoded surrogate */
    NO_ROUTE("{\"upstream\":\"\xf4\x90\x80\x80\"}"); /* past U+10FFFF */
    NO_ROUTE("{\"upstream\":\"\xe2\x82\"}");         /* truncated */
    NO_ROUTE("{\"upstream\":\"a\nb\"}");
    NO_ROUTE("{\"upstream\":\"x");

    /* Any nesting depth in a skipped value (serde_json's ignore_value has no limit). */
    size_t depth = 100000;
    size_t len = depth * 2 + 64;
    char *deep = malloc(len);
    if (deep == NULL)
        abort();
    size_t o = (size_t)sprintf(deep, "{\"a\":");
    memset(deep + o, '[', depth);
    o += depth;
    memset(deep + o, ']', depth);
    o += depth;
    o += (size_t)sprintf(deep + o, ",\"upstream\":\"deep\"}");
    size_t n = 0;
    char *got = upstream_of((const uint8_t *)deep, o, &n);
    CHECK(got != NULL && strcmp(got, "deep") == 0, "deeply nested skip");
    free(got);
    deep[5 + depth] = '}'; /* one mismatched closer */
    got = upstream_of((const uint8_t *)deep, o, &n);
    CHECK(got == NULL, "mismatched closer deep inside");
    free(got);
    free(deep);
}

/* router_query's answer as a NUL-terminated string, and whether it was an error. */
static char *query(const struct router *r, const char *host, size_t len, bool *is_error)
{
    size_t n;
    uint8_t *out = router_query(r, (const uint8_t *)host, len, &n, is_error);
    if (out == NULL)
        abort();
    char *s = malloc(n + 1);
    if (s == NULL)
        abort();
    memcpy(s, out, n);
    s[n] = '\0';
    free(out);
    return s;
}

static void expect_query(const struct router *r, const char *host, const char *want, bool error,
                         int line)
{
    bool is_error;
    char *got = query(r, host, strlen(host), &is_error);
    CHECK(is_error == error && strcmp(got, want) == 0, "line %d: query %s: got %s%s", line, host,
          is_error ? "error " : "", got);
    free(got);
}
#define QUERY_OK(r, host, want) expect_query(r, host, want, false, __LINE__)
#define QUERY_ERR(r, host, want) expect_query(r, host, want, true, __LINE__)

struct update {
    const char *key;
    const char *value; /* NULL: a delete */
};

/* One batch through parse and apply; returns the verdicts as a string of 'a' / 's'. */
static void batch(struct router *r, const struct update *u, size_t n, char *verdicts)
{
    if (!router_begin_batch(r, n))
        abort();
    for (size_t i = 0; i < n; i++) {
        bool ok;
        const char *v = u[i].value ? u[i].value : "";
        enum verdict verdict = router_parse(r, (const uint8_t *)u[i].key, strlen(u[i].key),
                                            (const uint8_t *)v, strlen(v), u[i].value != NULL, &ok);
        if (!ok)
            abort();
        verdicts[i] = verdict == VERDICT_ACCEPT ? 'a' : 's';
    }
    verdicts[n] = '\0';
    if (!router_apply(r))
        abort();
}

static void test_router(void)
{
    struct router r = ROUTER_INIT;
    char v[16];

    /* parse_routes: scope and empty hosts. */
    const struct update scope[] = {
        {"route.a.example", "{\"upstream\": \"10.0.0.1:80\", \"extra\": 1}"},
        {"route.", "{\"upstream\": \"1:80\"}"}, /* empty host: skipped */
        {"other.a", "{\"upstream\": \"1:80\"}"}, /* out of scope */
        {"route", "{\"upstream\": \"1:80\"}"},
        {"route.", NULL},                        /* in scope: accepted, removes nothing */
        {"other.b", NULL},
    };
    batch(&r, scope, 6, v);
    CHECK(strcmp(v, "asssas") == 0, "verdicts %s", v);
    QUERY_OK(&r, "a.example", "{\"upstream\":\"10.0.0.1:80\"}");
    CHECK(r.len == 1, "len %zu", r.len);

    /* a_value_that_is_not_a_route_removes_the_route */
    const struct update bad[] = {{"route.a", "{\"upstream\":\"1:80\"}"},
                                 {"route.b", "{\"upstream\":\"2:80\"}"}};
    batch(&r, bad, 2, v);
    const struct update not_routes[] = {
        {"route.a", "not json"}, {"route.b", "{\"upstream\": \"\"}"}};
    batch(&r, not_routes, 2, v);
    CHECK(strcmp(v, "aa") == 0, "verdicts %s", v);
    QUERY_ERR(&r, "a", "unknown host: a");
    QUERY_ERR(&r, "b", "unknown host: b");

    /* fold_and_query: deletes, replacement, escaping in the answer, order inside a batch. */
    const struct update fold[] = {{"route.a", "{\"upstream\":\"1:80\"}"},
                                  {"route.b", "{\"upstream\":\"2:80\"}"}};
    batch(&r, fold, 2, v);
    QUERY_OK(&r, "a", "{\"upstream\":\"1:80\"}");
    const struct update fold2[] = {{"route.a", NULL},
                                   {"route.b", "{\"upstream\":\"3\\\"x\"}"},
                                   {"route.c", "{\"upstream\":\"first\"}"},
                                   {"route.c", NULL},
                                   {"route.d", NULL},
                                   {"route.d", "{\"upstream\":\"last\"}"}};
    batch(&r, fold2, 6, v);
    QUERY_ERR(&r, "a", "unknown host: a");
    QUERY_OK(&r, "b", "{\"upstream\":\"3\\\"x\"}");
    QUERY_ERR(&r, "c", "unknown host: c");
    QUERY_OK(&r, "d", "{\"upstream\":\"last\"}");

    /* A parse that is never applied is dropped by the next one. */
    const struct update lost[] = {{"route.lost", "{\"upstream\":\"x\"}"}};
    if (!router_begin_batch(&r, 1))
        abort();
    bool ok;
    router_parse(&r, (const uint8_t *)lost[0].key, strlen(lost[0].key),
                 (const uint8_t *)lost[0].value, strlen(lost[0].value), true, &ok);
    batch(&r, NULL, 0, v);
    QUERY_ERR(&r, "lost", "unknown host: lost");

    /* The answer escapes exactly what serde_json escapes. */
    const struct update esc[] = {
        {"route.e", "{\"upstream\":\"\\\"\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\\u007f\\u00e9\"}"}};
    batch(&r, esc, 1, v);
    QUERY_OK(&r, "e", "{\"upstream\":\"\\\"\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\x7f\xc3\xa9\"}");

    /* A request that is not UTF-8 is read lossily, as String::from_utf8_lossy reads it: each
     * maximal ill-formed subsequence is one U+FFFD, and the result is looked up as it is. */
    QUERY_ERR(&r, "a\xff" "b", "unknown host: a\xef\xbf\xbd" "b");
    QUERY_ERR(&r, "\xe2\x82" "x", "unknown host: \xef\xbf\xbd" "x");  /* truncated: one */
    QUERY_ERR(&r, "\xf0\x9f\x98", "unknown host: \xef\xbf\xbd");
    QUERY_ERR(&r, "\xed\xa0\x80", "unknown host: \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    QUERY_ERR(&r, "\xc0\xaf", "unknown host: \xef\xbf\xbd\xef\xbf\xbd");
    QUERY_ERR(&r, "\xf4\x90\x80\x80",
              "unknown host: \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    QUERY_ERR(&r, "", "unknown host: ");
    const struct update lossy[] = {{"route.x\xef\xbf\xbdy", "{\"upstream\":\"replaced\"}"}};
    batch(&r, lossy, 1, v);
    QUERY_OK(&r, "x\x80y", "{\"upstream\":\"replaced\"}");
    bool is_error;
    char *nul = query(&r, "a\0b", 3, &is_error);
    CHECK(is_error && memcmp(nul, "unknown host: a\0b", 17) == 0, "NUL in a request");
    free(nul);

    router_free(&r);
}

/* A reference model for the table: a plain array, searched linearly. */
#define HOSTS 20000

static void test_table_churn(void)
{
    static char *model[HOSTS]; /* upstream of host i, or NULL */
    struct router r = ROUTER_INIT;
    uint64_t x = 0x9E3779B97F4A7C15u; /* xorshift64: a fixed, reproducible sequence */
    char key[32], value[64], v[101];
    struct update u[100];
    char keys[100][32], values[100][64];

    for (int round = 0; round < 1000; round++) {
        size_t n = 0;
        for (; n < 100; n++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            unsigned host = (unsigned)(x % HOSTS);
            snprintf(keys[n], sizeof keys[n], "route.h%05u", host);
            u[n].key = keys[n];
            if ((x >> 32) % 4 == 0) {
                u[n].value = NULL;
            } else {
                snprintf(values[n], sizeof values[n], "{\"upstream\":\"10.%u.%u:%u\"}",
                         host / 250, host % 250, round);
                u[n].value = values[n];
            }
        }
        batch(&r, u, n, v);
        for (size_t i = 0; i < n; i++) {
            unsigned host = (unsigned)strtoul(keys[i] + 7, NULL, 10);
            free(model[host]);
            model[host] = NULL;
            if (u[i].value != NULL) {
                size_t len;
                model[host] = upstream_of((const uint8_t *)u[i].value, strlen(u[i].value), &len);
            }
        }
    }
    size_t live = 0;
    int mismatches = 0;
    for (unsigned host = 0; host < HOSTS; host++) {
        snprintf(key, sizeof key, "h%05u", host);
        const struct route *got = router_get(&r, (const uint8_t *)key, strlen(key));
        if (model[host] == NULL) {
            mismatches += got != NULL;
        } else {
            live++;
            size_t len = strlen(model[host]);
            mismatches += got == NULL || got->upstream_len != len ||
                          memcmp(got->bytes + got->host_len, model[host], len) != 0;
        }
        free(model[host]);
    }
    CHECK(mismatches == 0, "%d hosts differ from the model", mismatches);
    CHECK(r.len == live, "len %zu, model %zu", r.len, live);
    CHECK(r.capacity <= 4 * (live + 100) + 64, "capacity %zu for %zu hosts", r.capacity, live);
    (void)value;
    router_free(&r);
}

int main(void)
{
    test_json();
    test_router();
    test_table_churn();
    printf("router-c native: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
