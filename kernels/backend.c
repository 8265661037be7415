/*
 * backend.c — backend selection by name (kernels/backend.h).
 *
 * "cpu" is always available.  "cuda" is answered with DSV4_ERR_NOTSUP until
 * the CUDA backend registers its constructor here.
 */
#include "kernels/backend.h"

#include <string.h>

enum dsv4_err
dsv4_backend_create(struct dsv4_backend **out, const char *name, enum dsv4_numerics numerics,
                    int n_threads)
{
    *out = NULL;
    if (name == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "backend: no name given");
    if (strcmp(name, "cpu") == 0)
        return dsv4_cpu_backend_create(out, numerics, n_threads);
    if (strcmp(name, "cuda") == 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "backend: the CUDA backend is not available "
                            "in this build");
    return dsv4_err_set(DSV4_ERR_INVAL, "backend: unknown backend \"%s\" (expected cpu or "
                        "cuda)", name);
}

void
dsv4_backend_destroy(struct dsv4_backend *be)
{
    if (be != NULL)
        be->ops->destroy(be);
}
