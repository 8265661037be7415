/*
 * backend.c — backend selection by name (kernels/backend.h).
 *
 * "cpu" is always available.  "cuda" runs dsv4_cuda_backend_create on the
 * current device in builds with CUDA (DSV4_HAVE_CUDA, set by
 * kernels/meson.build) and is answered with DSV4_ERR_NOTSUP otherwise.
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
    if (strcmp(name, "cuda") == 0) {
#ifdef DSV4_HAVE_CUDA
        return dsv4_cuda_backend_create(out, numerics, -1);
#else
        return dsv4_err_set(DSV4_ERR_NOTSUP, "backend: the CUDA backend is not available "
                            "in this build");
#endif
    }
    return dsv4_err_set(DSV4_ERR_INVAL, "backend: unknown backend \"%s\" (expected cpu or "
                        "cuda)", name);
}

void
dsv4_backend_destroy(struct dsv4_backend *be)
{
    if (be != NULL)
        be->ops->destroy(be);
}
