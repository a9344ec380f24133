/*
 * router-c's exports: the glue between the bindings that `wit-bindgen c` generates from
 * wit/guest.wit at build time (guest.h, guest.c; never checked in) and the router in router.c.
 *
 * Ownership, as the generated code defines it: an export owns its arguments and frees them; what
 * it returns must be malloc'd (the generated post-return functions free every non-empty string and
 * list). Where the WIT gives a call no error channel (manifest, parse) a failed malloc traps, as a
 * Rust guest aborts; the host then fails the batch and retries it on a fresh instance.
 */
#include <stdlib.h>

#include "guest.h"
#include "router.h"

/* The guest's state. One instance of the component has one linear memory and is never entered
 * concurrently, and a fresh instance (the host makes one after any failure) starts from zero. */
static struct router state = ROUTER_INIT;

static void *checked_malloc(size_t n)
{
    void *p = malloc(n);
    if (p == NULL)
        abort(); /* wasi-libc's abort is the `unreachable` instruction: a trap, no import */
    return p;
}

void exports_foldhost_guest_folder_manifest(exports_foldhost_guest_folder_guest_manifest_t *ret)
{
    guest_string_dup(&ret->name, "router-c");
    guest_string_dup(&ret->version, "0.1.0");
    ret->scope.ptr = checked_malloc(sizeof *ret->scope.ptr);
    ret->scope.len = 1;
    guest_string_dup(&ret->scope.ptr[0], ROUTER_PREFIX);
}

bool exports_foldhost_guest_folder_init(guest_list_tuple2_string_string_t *config,
                                        guest_string_t *err)
{
    (void)err; /* every configuration is fine: the router has no settings */
    guest_list_tuple2_string_string_free(config);
    return true;
}

void exports_foldhost_guest_folder_parse(exports_foldhost_guest_folder_list_update_t *batch,
                                         exports_foldhost_guest_folder_list_verdict_t *ret)
{
    size_t n = batch->len;
    ret->ptr = n > 0 ? checked_malloc(n * sizeof *ret->ptr) : NULL;
    ret->len = n;
    if (!router_begin_batch(&state, n))
        abort();
    for (size_t i = 0; i < n; i++) {
        const exports_foldhost_guest_folder_update_t *u = &batch->ptr[i];
        bool ok;
        enum verdict v = router_parse(&state, u->key.ptr, u->key.len, u->value.ptr, u->value.len,
                                      u->op == FOLDHOST_GUEST_TYPES_OP_PUT, &ok);
        if (!ok)
            abort();
        ret->ptr[i] = v == VERDICT_ACCEPT ? FOLDHOST_GUEST_TYPES_VERDICT_ACCEPT
                                          : FOLDHOST_GUEST_TYPES_VERDICT_SKIP;
    }
    exports_foldhost_guest_folder_list_update_free(batch);
}

bool exports_foldhost_guest_folder_apply(guest_string_t *err)
{
    if (router_apply(&state))
        return true;
    guest_string_dup(err, "out of memory: the routing table cannot grow");
    return false;
}

void exports_foldhost_guest_folder_on_applied(uint64_t cursor)
{
    (void)cursor; /* the table is complete as soon as apply returns */
}

bool exports_foldhost_guest_folder_query(guest_list_u8_t *request, guest_list_u8_t *ret,
                                         guest_string_t *err)
{
    size_t n;
    bool is_error;
    uint8_t *answer = router_query(&state, request->ptr, request->len, &n, &is_error);
    guest_list_u8_free(request);
    if (answer == NULL) {
        guest_string_dup(err, "out of memory");
        return false;
    }
    if (is_error) {
        err->ptr = answer; /* valid UTF-8: router_query made it so */
        err->len = n;
        return false;
    }
    ret->ptr = answer;
    ret->len = n;
    return true;
}
