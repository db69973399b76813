/* coordkit's own view of the libzmq 4.x ABI.
 *
 * The extensions never link libzmq: they must call the very copy pyzmq
 * loaded (pyzmq wheels bundle their own, and two copies on one socket is
 * undefined behaviour). ck_zmq_bind() finds its symbols with
 * dlopen(RTLD_NOLOAD) + dlsym into a table of function pointers; the static
 * inline wrappers below give the rest of the code libzmq's own names.
 */
#ifndef COORDKIT_LIBZMQ_H
#define COORDKIT_LIBZMQ_H

#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* libzmq 4.x: 64 opaque bytes, pointer-aligned. */
typedef struct ck_zmq_msg_t {
    unsigned char _[64];
} __attribute__((aligned(sizeof(void *)))) zmq_msg_t;

typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} zmq_pollitem_t;

typedef void(zmq_free_fn)(void *data, void *hint);

#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_POLLIN 1
#define ZMQ_POLLOUT 2
#define ZMQ_EVENTS 15
#define ZMQ_SRCFD 2 /* a message property: the fd of the connection it came on (-1: none) */
#define ZMQ_HAUSNUMERO 156384712
#define CK_ETERM (ZMQ_HAUSNUMERO + 53)

typedef struct {
    int (*msg_init)(zmq_msg_t *);
    int (*msg_init_size)(zmq_msg_t *, size_t);
    int (*msg_init_data)(zmq_msg_t *, void *, size_t, zmq_free_fn *, void *);
    int (*msg_recv)(zmq_msg_t *, void *, int);
    int (*msg_send)(zmq_msg_t *, void *, int);
    int (*msg_close)(zmq_msg_t *);
    int (*msg_copy)(zmq_msg_t *, zmq_msg_t *);
    int (*msg_move)(zmq_msg_t *, zmq_msg_t *);
    void *(*msg_data)(zmq_msg_t *);
    size_t (*msg_size)(const zmq_msg_t *);
    int (*msg_more)(const zmq_msg_t *);
    int (*msg_get)(const zmq_msg_t *, int);
    int (*poll)(zmq_pollitem_t *, int, long);
    int (*errno_)(void);
    const char *(*strerror)(int);
    void (*version)(int *, int *, int *);
    int (*getsockopt)(void *, int, void *, size_t *);
} ck_zmq_api_t;

static ck_zmq_api_t ck_zmq;

/* Bind the table to the libzmq already loaded from `path`. 0 on success;
 * -1 with a reason in `err` otherwise. */
static int ck_zmq_bind(const char *path, char *err, size_t errlen)
{
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle == NULL) {
        snprintf(err, errlen, "%s is not loaded in this process (%s)", path, dlerror());
        return -1;
    }
    ck_zmq_api_t api;
#define CK_SYM(field, name)                                                        \
    *(void **)(&api.field) = dlsym(handle, name);                                  \
    if (api.field == NULL) {                                                       \
        snprintf(err, errlen, "%s has no symbol %s", path, name);                  \
        dlclose(handle);                                                           \
        return -1;                                                                 \
    }
    CK_SYM(msg_init, "zmq_msg_init")
    CK_SYM(msg_init_size, "zmq_msg_init_size")
    CK_SYM(msg_init_data, "zmq_msg_init_data")
    CK_SYM(msg_recv, "zmq_msg_recv")
    CK_SYM(msg_send, "zmq_msg_send")
    CK_SYM(msg_close, "zmq_msg_close")
    CK_SYM(msg_copy, "zmq_msg_copy")
    CK_SYM(msg_move, "zmq_msg_move")
    CK_SYM(msg_data, "zmq_msg_data")
    CK_SYM(msg_size, "zmq_msg_size")
    CK_SYM(msg_more, "zmq_msg_more")
    CK_SYM(msg_get, "zmq_msg_get")
    CK_SYM(poll, "zmq_poll")
    CK_SYM(errno_, "zmq_errno")
    CK_SYM(strerror, "zmq_strerror")
    CK_SYM(version, "zmq_version")
    CK_SYM(getsockopt, "zmq_getsockopt")
#undef CK_SYM
    int major = 0, minor = 0, patch = 0;
    api.version(&major, &minor, &patch);
    if (major != 4) {
        snprintf(err, errlen, "%s is libzmq %d.%d.%d; coordkit needs the 4.x ABI", path,
                 major, minor, patch);
        dlclose(handle);
        return -1;
    }
    /* The handle stays open: pyzmq keeps the library loaded for the process. */
    ck_zmq = api;
    return 0;
}

static inline int ck_msg_init(zmq_msg_t *m) { return ck_zmq.msg_init(m); }
static inline int ck_msg_init_size(zmq_msg_t *m, size_t n) { return ck_zmq.msg_init_size(m, n); }
static inline int ck_msg_init_data(zmq_msg_t *m, void *d, size_t n, zmq_free_fn *f, void *h)
{
    return ck_zmq.msg_init_data(m, d, n, f, h);
}
static inline int ck_msg_recv(zmq_msg_t *m, void *s, int flags) { return ck_zmq.msg_recv(m, s, flags); }
static inline int ck_msg_send(zmq_msg_t *m, void *s, int flags) { return ck_zmq.msg_send(m, s, flags); }
static inline int ck_msg_close(zmq_msg_t *m) { return ck_zmq.msg_close(m); }
static inline int ck_msg_copy(zmq_msg_t *d, zmq_msg_t *s) { return ck_zmq.msg_copy(d, s); }
static inline int ck_msg_move(zmq_msg_t *d, zmq_msg_t *s) { return ck_zmq.msg_move(d, s); }
static inline void *ck_msg_data(zmq_msg_t *m) { return ck_zmq.msg_data(m); }
static inline size_t ck_msg_size(const zmq_msg_t *m) { return ck_zmq.msg_size(m); }
static inline int ck_msg_more(const zmq_msg_t *m) { return ck_zmq.msg_more(m); }
static inline int ck_msg_get(const zmq_msg_t *m, int property) { return ck_zmq.msg_get(m, property); }
static inline int ck_poll(zmq_pollitem_t *items, int n, long timeout) { return ck_zmq.poll(items, n, timeout); }
static inline int ck_errno(void) { return ck_zmq.errno_(); }
static inline const char *ck_strerror(int e) { return ck_zmq.strerror(e); }
static inline int ck_getsockopt(void *s, int option, void *value, size_t *size)
{
    return ck_zmq.getsockopt(s, option, value, size);
}

#endif
