/* exs: out-of-line wrappers for the libfabric calls that are static inline in its headers (Rust cannot call
 * static inline functions; these forward to the provider's ops tables), and the library's own functions, through
 * libfabric loaded when first needed. */
#ifndef EXS_FI_SHIM_H
#define EXS_FI_SHIM_H

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

int exs_fi_close(struct fid *fid);
int exs_fi_control(struct fid *fid, int command, void *arg);
int exs_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int exs_fi_eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr, struct fid_eq **eq, void *context);
int exs_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int exs_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
void *exs_fi_mr_desc(struct fid_mr *mr);
uint64_t exs_fi_mr_key(struct fid_mr *mr);
int exs_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int exs_fi_mr_enable(struct fid_mr *mr);
int exs_fi_passive_ep(struct fid_fabric *fabric, struct fi_info *info, struct fid_pep **pep, void *context);
int exs_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int exs_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int exs_fi_pep_bind(struct fid_pep *pep, struct fid *bfid, uint64_t flags);
int exs_fi_enable(struct fid_ep *ep);
int exs_fi_getname(fid_t fid, void *addr, size_t *addrlen);
int exs_fi_getpeer(struct fid_ep *ep, void *addr, size_t *addrlen);
int exs_fi_listen(struct fid_pep *pep);
int exs_fi_connect(struct fid_ep *ep, const void *addr, const void *param, size_t paramlen);
int exs_fi_accept(struct fid_ep *ep, const void *param, size_t paramlen);
int exs_fi_reject(struct fid_pep *pep, fid_t handle, const void *param, size_t paramlen);
int exs_fi_shutdown(struct fid_ep *ep, uint64_t flags);
ssize_t exs_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, void *context);
ssize_t exs_fi_sendv(struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count, void *context);
ssize_t exs_fi_senddata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data, void *context);
ssize_t exs_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t addr, uint64_t key,
                     void *context);
ssize_t exs_fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data, uint64_t addr,
                         uint64_t key, void *context);
ssize_t exs_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t exs_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, uint64_t addr, uint64_t key,
                    void *context);
ssize_t exs_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t exs_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
ssize_t exs_fi_eq_read(struct fid_eq *eq, uint32_t *event, void *buf, size_t len, uint64_t flags);
ssize_t exs_fi_eq_readerr(struct fid_eq *eq, struct fi_eq_err_entry *buf, uint64_t flags);
int exs_fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count);
struct fi_info *exs_fi_allocinfo(void);

/* libfabric itself, loaded on first use (see shim.c; `EXS_FABRIC_LIBRARY` names another file): why it could not
 * be, or NULL once it is. */
#define EXS_FI_LIBRARY "libfabric.so.1"
const char *exs_fi_load_error(void);
int exs_fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                   const struct fi_info *hints, struct fi_info **info);
void exs_fi_freeinfo(struct fi_info *info);
struct fi_info *exs_fi_dupinfo(const struct fi_info *info);
int exs_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
const char *exs_fi_strerror(int errnum);

#endif
