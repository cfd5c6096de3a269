/* exs: out-of-line wrappers for libfabric's static inline calls, and libfabric loaded when first needed. See
 * shim.h. */
#define _GNU_SOURCE /* dlvsym, secure_getenv */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "shim.h"

/* The version of each of the library's own functions that linking against the build's libfabric would have bound
 * (its defaults there, found by build.rs); without one, the default of the library loaded. */
#ifndef EXS_FI_V_GETINFO
#define EXS_FI_V_GETINFO NULL
#endif
#ifndef EXS_FI_V_FREEINFO
#define EXS_FI_V_FREEINFO NULL
#endif
#ifndef EXS_FI_V_DUPINFO
#define EXS_FI_V_DUPINFO NULL
#endif
#ifndef EXS_FI_V_FABRIC
#define EXS_FI_V_FABRIC NULL
#endif
#ifndef EXS_FI_V_STRERROR
#define EXS_FI_V_STRERROR NULL
#endif

/* The library's own functions (the inline calls above go through the ops tables of objects it made), found once
 * libfabric is loaded. Not linked: loading it runs its dependencies' constructors (the psm provider's
 * libinfinipath calibrates the CPU clock for about 0.2 s), which a process that never opens a fabric context does
 * not pay. Loaded RTLD_GLOBAL, as a linked library's symbols are seen. */
static struct {
    int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *, struct fi_info **);
    void (*freeinfo)(struct fi_info *);
    struct fi_info *(*dupinfo)(const struct fi_info *);
    int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
    const char *(*strerror)(int);
    char error[256];
} lib;
static pthread_once_t lib_once = PTHREAD_ONCE_INIT;

/* `name` at `version` (as linking would bind it: a library without that version is refused, as it would refuse to
 * start a linked program), or at the library's default without one; NULL and the reason in lib.error if absent. */
static void *lib_sym(void *h, const char *file, const char *name, const char *version)
{
    void *p = version ? dlvsym(h, name, version) : dlsym(h, name);
    if (!p && !lib.error[0])
        snprintf(lib.error, sizeof lib.error,
                 "%s has no %s%s%s (not libfabric, or older than the one exs was built against)", file, name,
                 version ? "@" : "", version ? version : "");
    return p;
}

static void lib_load(void)
{
    const char *name = secure_getenv("EXS_FABRIC_LIBRARY");
    if (!name || !*name)
        name = EXS_FI_LIBRARY;
    void *h = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        snprintf(lib.error, sizeof lib.error, "%s", dlerror());
        return;
    }
    lib.freeinfo = (void (*)(struct fi_info *))lib_sym(h, name, "fi_freeinfo", EXS_FI_V_FREEINFO);
    lib.dupinfo = (struct fi_info * (*)(const struct fi_info *)) lib_sym(h, name, "fi_dupinfo", EXS_FI_V_DUPINFO);
    lib.fabric = (int (*)(struct fi_fabric_attr *, struct fid_fabric **, void *))lib_sym(h, name, "fi_fabric",
                                                                                        EXS_FI_V_FABRIC);
    lib.strerror = (const char *(*)(int))lib_sym(h, name, "fi_strerror", EXS_FI_V_STRERROR);
    /* Last: its being set says every one was found. */
    void *getinfo = lib_sym(h, name, "fi_getinfo", EXS_FI_V_GETINFO);
    if (lib.freeinfo && lib.dupinfo && lib.fabric && lib.strerror)
        lib.getinfo = (int (*)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *,
                               struct fi_info **))getinfo;
}

const char *exs_fi_load_error(void)
{
    pthread_once(&lib_once, lib_load);
    return lib.getinfo ? NULL : lib.error;
}

int exs_fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                   const struct fi_info *hints, struct fi_info **info)
{
    if (exs_fi_load_error())
        return -FI_ENOSYS;
    return lib.getinfo(version, node, service, flags, hints, info);
}

/* Only ever given what the loaded library made. */
void exs_fi_freeinfo(struct fi_info *info)
{
    if (!exs_fi_load_error())
        lib.freeinfo(info);
}

struct fi_info *exs_fi_dupinfo(const struct fi_info *info)
{
    return exs_fi_load_error() ? NULL : lib.dupinfo(info);
}

struct fi_info *exs_fi_allocinfo(void) { return exs_fi_dupinfo(NULL); }

int exs_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context)
{
    if (exs_fi_load_error())
        return -FI_ENOSYS;
    return lib.fabric(attr, fabric, context);
}

const char *exs_fi_strerror(int errnum)
{
    return exs_fi_load_error() ? "libfabric is not loaded" : lib.strerror(errnum);
}

int exs_fi_close(struct fid *fid) { return fi_close(fid); }
int exs_fi_control(struct fid *fid, int command, void *arg) { return fi_control(fid, command, arg); }
int exs_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context)
{ return fi_domain(fabric, info, domain, context); }
int exs_fi_eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr, struct fid_eq **eq, void *context)
{ return fi_eq_open(fabric, attr, eq, context); }
int exs_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context)
{ return fi_cq_open(domain, attr, cq, context); }
int exs_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context)
{ return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags, mr, context); }
void *exs_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t exs_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
int exs_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags) { return fi_mr_bind(mr, bfid, flags); }
int exs_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
int exs_fi_passive_ep(struct fid_fabric *fabric, struct fi_info *info, struct fid_pep **pep, void *context)
{ return fi_passive_ep(fabric, info, pep, context); }
int exs_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context)
{ return fi_endpoint(domain, info, ep, context); }
int exs_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags) { return fi_ep_bind(ep, bfid, flags); }
int exs_fi_pep_bind(struct fid_pep *pep, struct fid *bfid, uint64_t flags) { return fi_pep_bind(pep, bfid, flags); }
int exs_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int exs_fi_getname(fid_t fid, void *addr, size_t *addrlen) { return fi_getname(fid, addr, addrlen); }
int exs_fi_getpeer(struct fid_ep *ep, void *addr, size_t *addrlen) { return fi_getpeer(ep, addr, addrlen); }
int exs_fi_listen(struct fid_pep *pep) { return fi_listen(pep); }
int exs_fi_connect(struct fid_ep *ep, const void *addr, const void *param, size_t paramlen)
{ return fi_connect(ep, addr, param, paramlen); }
int exs_fi_accept(struct fid_ep *ep, const void *param, size_t paramlen) { return fi_accept(ep, param, paramlen); }
int exs_fi_reject(struct fid_pep *pep, fid_t handle, const void *param, size_t paramlen)
{ return fi_reject(pep, handle, param, paramlen); }
int exs_fi_shutdown(struct fid_ep *ep, uint64_t flags) { return fi_shutdown(ep, flags); }
ssize_t exs_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, void *context)
{ return fi_recv(ep, buf, len, desc, 0, context); }
ssize_t exs_fi_sendv(struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count, void *context)
{ return fi_sendv(ep, iov, desc, count, 0, context); }
ssize_t exs_fi_senddata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data, void *context)
{ return fi_senddata(ep, buf, len, desc, data, 0, context); }
ssize_t exs_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t addr, uint64_t key,
                     void *context)
{ return fi_write(ep, buf, len, desc, 0, addr, key, context); }
ssize_t exs_fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data, uint64_t addr,
                         uint64_t key, void *context)
{ return fi_writedata(ep, buf, len, desc, data, 0, addr, key, context); }
ssize_t exs_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{ return fi_writemsg(ep, msg, flags); }
ssize_t exs_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, uint64_t addr, uint64_t key,
                    void *context)
{ return fi_read(ep, buf, len, desc, 0, addr, key, context); }
ssize_t exs_fi_cq_read(struct fid_cq *cq, void *buf, size_t count) { return fi_cq_read(cq, buf, count); }
ssize_t exs_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags)
{ return fi_cq_readerr(cq, buf, flags); }
ssize_t exs_fi_eq_read(struct fid_eq *eq, uint32_t *event, void *buf, size_t len, uint64_t flags)
{ return fi_eq_read(eq, event, buf, len, flags); }
ssize_t exs_fi_eq_readerr(struct fid_eq *eq, struct fi_eq_err_entry *buf, uint64_t flags)
{ return fi_eq_readerr(eq, buf, flags); }
int exs_fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count) { return fi_trywait(fabric, fids, count); }
