/* Placeholder: the shared-memory pool core is being written. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_shmpool", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__shmpool(void) { return PyModule_Create(&mod); }
