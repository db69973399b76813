/* Frames for libzmq from Python buffers: copied when small, pinned when large.
 *
 * A frame below `copy_below` bytes is copied into a message of its own: that
 * costs less than the bookkeeping of sharing it. A larger one is sent without
 * a copy (zmq_msg_init_data), its Python buffer held until libzmq is done with
 * it. libzmq calls the free function on whichever thread drops the last
 * reference -- usually its I/O thread, which must not touch Python objects
 * (it holds no GIL, and taking the GIL there could stall the I/O thread behind
 * Python or deadlock at exit). So the free function only pushes the pin onto a
 * lock-free stack; a thread that holds the GIL later takes the whole stack at
 * once (ck_pins_sweep) and releases the buffers. The endpoints sweep each time
 * they send or receive, so a pin outlives its message by at most one call.
 *
 * Push is a compare-and-swap loop, the sweep one atomic exchange: with only
 * pushes racing and "take everything" as the one pop, there is no ABA.
 * Each module that includes this has its own stack and sweeps it itself.
 */
#ifndef COORDKIT_PINS_H
#define COORDKIT_PINS_H

#include <Python.h>
#include <string.h>

#include "libzmq.h"

typedef struct ck_pin {
    struct ck_pin *next;
    Py_buffer view;
} ck_pin;

static ck_pin *ck_pins_released = NULL;

/* libzmq's free function: any thread, no GIL. */
static void ck_pin_release(void *data, void *hint)
{
    ck_pin *pin = (ck_pin *)hint;
    ck_pin *head = __atomic_load_n(&ck_pins_released, __ATOMIC_RELAXED);
    (void)data;
    do {
        pin->next = head;
    } while (!__atomic_compare_exchange_n(&ck_pins_released, &head, pin, 1, __ATOMIC_RELEASE,
                                          __ATOMIC_RELAXED));
}

/* Release the buffers libzmq is done with. The GIL must be held. */
static void ck_pins_sweep(void)
{
    ck_pin *pin = __atomic_exchange_n(&ck_pins_released, NULL, __ATOMIC_ACQUIRE);
    while (pin != NULL) {
        ck_pin *next = pin->next;
        PyBuffer_Release(&pin->view);
        PyMem_RawFree(pin);
        pin = next;
    }
}

/* Initialise `msg` with the bytes of `obj`, any object exporting a contiguous
 * buffer. 0, or -1 with a Python error set (and `msg` initialised empty).
 * The GIL must be held. */
static int ck_msg_from_object(zmq_msg_t *msg, PyObject *obj, size_t copy_below)
{
    Py_buffer view;
    ck_pin *pin;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) != 0)
        goto failed;
    if ((size_t)view.len < copy_below) {
        int rc = ck_msg_init_size(msg, (size_t)view.len);
        if (rc == 0 && view.len)
            memcpy(ck_msg_data(msg), view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
        if (rc != 0) {
            PyErr_NoMemory();
            goto failed;
        }
        return 0;
    }
    PyBuffer_Release(&view);
    /* The pin holds a buffer of its own, taken in place (a Py_buffer is not moved). */
    pin = (ck_pin *)PyMem_RawMalloc(sizeof(ck_pin));
    if (pin == NULL) {
        PyErr_NoMemory();
        goto failed;
    }
    if (PyObject_GetBuffer(obj, &pin->view, PyBUF_SIMPLE) != 0) {
        PyMem_RawFree(pin);
        goto failed;
    }
    if (ck_msg_init_data(msg, pin->view.buf, (size_t)pin->view.len, ck_pin_release, pin) != 0) {
        PyBuffer_Release(&pin->view);
        PyMem_RawFree(pin);
        PyErr_NoMemory();
        goto failed;
    }
    return 0;
failed:
    ck_msg_init(msg);
    return -1;
}

#endif
