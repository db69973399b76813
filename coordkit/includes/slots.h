/* Objects of a slotted class made without calling its __init__.
 *
 * The engine core hands out a Request per prompt, a frozen dataclass with
 * __slots__, and the client a future per request: going through their
 * __init__ (or a frozen dataclass's object.__setattr__) costs more than the
 * rest of the object's making. These allocate the object and set a slot
 * through its member descriptor, as __init__ would.
 */
#ifndef COORDKIT_SLOTS_H
#define COORDKIT_SLOTS_H

#include <Python.h>

/* A new, empty instance of `cls` (tp_alloc: no __new__, no __init__). */
static inline PyObject *ck_alloc(PyObject *cls)
{
    PyTypeObject *type = (PyTypeObject *)cls;
    return type->tp_alloc(type, 0);
}

/* obj.<slot> = value through the slot's member descriptor `descr`; -1 on error. */
static inline int ck_set_slot(PyObject *descr, PyObject *obj, PyObject *value)
{
    return Py_TYPE(descr)->tp_descr_set(descr, obj, value);
}

#endif
