/* exs: out-of-line wrappers for libfabric's static inline calls. See shim.h. */
#include "shim.h"

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
struct fi_info *exs_fi_allocinfo(void) { return fi_allocinfo(); }
