/* A stand-in libcuda.so.1 for running the cuda backend's Python where there
 * is no GPU (tests/backends/test_cuda_stand_in.py).  It is no simulation: "device"
 * memory is host memory, each enqueued item is done at once on the calling
 * thread, kernels do nothing, events and streams are always complete.  It
 * answers cuda-bindings (through cuGetProcAddress) and gpuflow's ctypes
 * calls (by name) with the few results their callers read.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef int CUresult;
typedef unsigned long long u64;
static __thread void *current_ctx = 0;
static uintptr_t next_handle = 0x10000;
static void *handle(void) { return (void *)__sync_fetch_and_add(&next_handle, 16); }
/* the context each stream and function was made in, by handle (the first
 * 64k handles): a launch of a function of one context on a stream of
 * another is refused, as the driver refuses it */
#define KNOWN 65536
static void *made_in[KNOWN];
static void *made(void *ctx) {
    void *h = handle();
    uintptr_t i = ((uintptr_t)h - 0x10000) / 16;
    if (i < KNOWN) made_in[i] = ctx;
    return h; }
static void *context_of(void *h) {
    uintptr_t i = ((uintptr_t)h - 0x10000) / 16;
    return (uintptr_t)h >= 0x10000 && i < KNOWN ? made_in[i] : 0; }

static CUresult ok(void) { return 0; }
CUresult cuInit(unsigned f) { return 0; }
int standin_driver_version = 13000;
CUresult cuDriverGetVersion(int *v) { *v = standin_driver_version; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int i) { *d = i; return 0; }
CUresult cuDeviceGetName(char *name, int len, int d) { strncpy(name, "Fake GPU", len); return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int d) {  /* an H100's: sm_90, 132 SMs */
    switch (attr) {
    case 75: *v = 9; break;              /* compute capability */
    case 76: *v = 0; break;
    case 16: *v = 132; break;            /* SMs */
    case 1: case 2: case 3: *v = 1024; break;  /* threads a block; block x, y */
    case 4: *v = 64; break;              /* block z */
    case 5: *v = 2147483647; break;      /* grid x */
    case 6: case 7: *v = 65535; break;   /* grid y, z */
    case 97: *v = 232448; break;         /* shared memory a block, opted into */
    default: *v = 1;
    }
    return 0; }
CUresult cuDeviceTotalMem(size_t *b, int d) { *b = (size_t)80 << 30; return 0; }
CUresult cuDeviceCanAccessPeer(int *ok_, int a, int b) { *ok_ = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) { *ctx = (void *)(0x1000 + 16 * (uintptr_t)d); return 0; }
CUresult cuDeviceGetDefaultMemPool(void **pool, int d) { *pool = (void *)0x2000; return 0; }
CUresult cuMemPoolGetAttribute(void *pool, int attr, void *value) { *(u64 *)value = 0; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { current_ctx = ctx; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current_ctx; return 0; }
/* every stream made, counted for the program (a latency class's first run
 * makes none: its pool is made when the runtime starts) */
int standin_streams = 0;
CUresult cuStreamCreate(void **s, unsigned f) { standin_streams++; *s = made(current_ctx); return 0; }
/* priorities as on current GPUs: 0 the lowest, -5 the highest; the last
 * number a stream was made with is kept, for the program to check */
int standin_priority = 1;
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) { *least = 0; *greatest = -5; return 0; }
CUresult cuStreamCreateWithPriority(void **s, unsigned f, int p) {
    standin_streams++; standin_priority = p; *s = made(current_ctx); return 0; }
/* green contexts: a device of 132 SMs split as CUDA 13 does on sm_90
 * (partitions of multiples of 8); what was made is counted, and the SMs of
 * the green context the last stream was made in are kept, for the program */
typedef struct {
    int type; unsigned char pad[92];
    union { unsigned sm[4]; unsigned char oversize[48]; } u;
    void *next;
} Resource;
int standin_green_contexts = 0, standin_green_streams = 0, standin_green_sms = 0;
int standin_modules = 0;
static unsigned desc_sms[1024];  /* (descriptors 0x7000 to 0xb000: below the handles) */
static int n_desc = 0;
CUresult cuDeviceGetDevResource(int d, Resource *r, int type) {
    memset(r, 0, sizeof *r); r->type = 1;
    r->u.sm[0] = 132; r->u.sm[1] = 8; r->u.sm[2] = 8; return 0; }
/* as the driver's, a split's outputs (marked in pad[0]) cannot be split
 * again: only a green context's resources (cuGreenCtxGetDevResource) can */
CUresult cuDevSmResourceSplitByCount(Resource *result, unsigned *nb, const Resource *in,
                                     Resource *left, unsigned flags, unsigned min) {
    unsigned n = (min + 7) / 8 * 8;
    if (in->pad[0] || n > in->u.sm[0]) return 915;  /* CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION */
    *left = *in; left->u.sm[0] = in->u.sm[0] - n; left->pad[0] = 1;
    if (result) { result[0] = *in; result[0].u.sm[0] = n; result[0].pad[0] = 1; }
    *nb = 1; return 0; }
CUresult cuDevResourceGenerateDesc(void **desc, Resource *res, unsigned n) {
    if (n_desc == 1024) return 2;
    desc_sms[n_desc] = res[0].u.sm[0];
    *desc = (void *)(uintptr_t)(0x7000 + 16 * n_desc++); return 0; }
int standin_green_fail_after = -1;  /* >= 0: that many more succeed, then one fails */
CUresult cuGreenCtxCreate(void **g, void *desc, int d, unsigned flags) {
    if (standin_green_fail_after == 0) { standin_green_fail_after = -1; return 2; }
    if (standin_green_fail_after > 0) standin_green_fail_after--;
    standin_green_contexts++; *g = (void *)((uintptr_t)desc + 0x1000); return 0; }
CUresult cuGreenCtxGetDevResource(void *g, Resource *r, int type) {
    cuDeviceGetDevResource(0, r, type);
    r->u.sm[0] = desc_sms[((uintptr_t)g - 0x8000) / 16]; return 0; }
CUresult cuCtxFromGreenCtx(void **ctx, void *g) { *ctx = (void *)((uintptr_t)g + 0x1000); return 0; }
CUresult cuGreenCtxStreamCreate(void **s, void *g, unsigned f, int p) {
    standin_streams++; standin_green_streams++; standin_priority = p;
    standin_green_sms = desc_sms[((uintptr_t)g - 0x8000) / 16];
    *s = made((void *)((uintptr_t)g + 0x1000)); return 0; }  /* (cuCtxFromGreenCtx's) */
CUresult cuGreenCtxDestroy(void *g) { standin_green_contexts--; return 0; }
static void *pushed = 0;
CUresult cuCtxPushCurrent(void *ctx) { pushed = current_ctx; current_ctx = ctx; return 0; }
CUresult cuCtxPopCurrent(void **ctx) { if (ctx) *ctx = current_ctx; current_ctx = pushed; return 0; }
CUresult cuStreamGetCtx(void *s, void **ctx) { *ctx = (void *)0x1000; return 0; }
CUresult cuEventCreate(void **e, unsigned f) { *e = handle(); return 0; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) { *ms = 0.0f; return 0; }
CUresult cuMemHostGetDevicePointer(u64 *d, void *p, unsigned f) { *d = (u64)(uintptr_t)p; return 0; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned f) { *p = calloc(1, n); return 0; }
CUresult cuStreamWriteValue64(void *s, u64 addr, u64 value, unsigned f) { *(volatile u64 *)(uintptr_t)addr = value; return 0; }
CUresult cuStreamWriteValue64_v2(void *s, u64 addr, u64 value, unsigned f) { return cuStreamWriteValue64(s, addr, value, f); }
typedef void (*hostfn)(void *);
CUresult cuLaunchHostFunc(void *s, hostfn fn, void *data) { fn(data); return 0; }
CUresult cuMemAllocAsync(u64 *p, size_t n, void *s) { *p = (u64)(uintptr_t)calloc(1, n ? n : 1); return 0; }
CUresult cuMemFreeAsync(u64 p, void *s) { free((void *)(uintptr_t)p); return 0; }
CUresult cuMemcpyHtoDAsync(u64 dst, const void *src, size_t n, void *s) { memcpy((void *)(uintptr_t)dst, src, n); return 0; }
CUresult cuMemcpyDtoHAsync(void *dst, u64 src, size_t n, void *s) { memcpy(dst, (void *)(uintptr_t)src, n); return 0; }
CUresult cuMemcpyDtoDAsync(u64 dst, u64 src, size_t n, void *s) { memmove((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n); return 0; }
CUresult cuMemcpyPeerAsync(u64 dst, void *dc, u64 src, void *sc, size_t n, void *s) { return cuMemcpyDtoDAsync(dst, src, n, s); }
CUresult cuMemsetD8Async(u64 p, unsigned char v, size_t n, void *s) { memset((void *)(uintptr_t)p, v, n); return 0; }
CUresult cuMemsetD16Async(u64 p, unsigned short v, size_t n, void *s) { unsigned short *q = (void *)(uintptr_t)p; for (size_t i = 0; i < n; i++) q[i] = v; return 0; }
CUresult cuMemsetD32Async(u64 p, unsigned v, size_t n, void *s) { unsigned *q = (void *)(uintptr_t)p; for (size_t i = 0; i < n; i++) q[i] = v; return 0; }
/* a launch runs nothing; it keeps the values of its first standin_record
 * parameters (8 bytes each), for the program to check what was passed */
int standin_record = 0;
u64 standin_params[8];
/* a module load waits for the kernels running on the device, as the driver's
 * does: with standin_kernel_ns set, a launch counts as running that long
 * (nothing else waits for it), and a load sleeps until the last one ends;
 * the loads that waited are counted */
long long standin_kernel_ns = 0;
int standin_load_waits = 0;
static u64 busy_until = 0;
static u64 now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return (u64)t.tv_sec * 1000000000ull + (u64)t.tv_nsec; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, void *s, void **params, void **extra) {
    void *fc = context_of(f), *sc = context_of(s);
    if (fc && sc && fc != sc) return 400;  /* CUDA_ERROR_INVALID_HANDLE */
    for (int i = 0; i < standin_record && i < 8; i++) standin_params[i] = *(u64 *)params[i];
    if (standin_kernel_ns > 0) {
        u64 end = now_ns() + (u64)standin_kernel_ns;
        if (end > busy_until) busy_until = end;
    }
    return 0;
}
CUresult cuModuleLoadData(void **m, const void *image) {
    u64 now = now_ns();
    if (busy_until > now) {
        struct timespec t = {(time_t)((busy_until - now) / 1000000000ull),
                             (long)((busy_until - now) % 1000000000ull)};
        standin_load_waits++;
        nanosleep(&t, 0);
    }
    standin_modules++; *m = handle(); return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) { *f = made(current_ctx); return 0; }
CUresult cuModuleGetFunctionCount(unsigned *n, void *m) { *n = 0; return 0; }
CUresult cuStreamEndCapture(void *s, void **g) { *g = handle(); return 0; }
CUresult cuGraphGetNodes(void *g, void **nodes, size_t *n) { *n = 0; return 0; }
CUresult cuGraphInstantiate(void **e, void *g, u64 flags) { *e = handle(); return 0; }
CUresult cuGraphInstantiateWithFlags(void **e, void *g, u64 flags) { *e = handle(); return 0; }
CUresult cuPointerGetAttribute(void *data, int attr, u64 p) {
    switch (attr) {
    case 2: *(unsigned *)data = 2; break;           /* MEMORY_TYPE: device */
    case 9: *(int *)data = 0; break;                /* DEVICE_ORDINAL */
    case 12: *(u64 *)data = p; break;               /* RANGE_START_ADDR */
    case 13: *(size_t *)data = (size_t)1 << 40; break; /* RANGE_SIZE */
    default: *(u64 *)data = 0;
    }
    return 0;
}

/* no stream of the stand-in is ever captured by another library */
CUresult cuStreamIsCapturing(void *s, int *status) { *status = 0; return 0; }
#define ROUTE(n) if (strcmp(symbol, #n) == 0) { *pfn = (void *)n; goto done; }
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, u64 flags, int *status) {
    ROUTE(cuDeviceGetDevResource) ROUTE(cuDevSmResourceSplitByCount)
    ROUTE(cuDevResourceGenerateDesc) ROUTE(cuGreenCtxCreate) ROUTE(cuCtxFromGreenCtx)
    ROUTE(cuGreenCtxStreamCreate) ROUTE(cuGreenCtxDestroy) ROUTE(cuGreenCtxGetDevResource) ROUTE(cuCtxPushCurrent)
    ROUTE(cuCtxPopCurrent)
    ROUTE(cuInit) ROUTE(cuDriverGetVersion) ROUTE(cuDeviceGetCount) ROUTE(cuDeviceGet)
    ROUTE(cuDeviceGetName) ROUTE(cuDeviceGetAttribute) ROUTE(cuDeviceTotalMem)
    ROUTE(cuDeviceCanAccessPeer) ROUTE(cuDevicePrimaryCtxRetain) ROUTE(cuDeviceGetDefaultMemPool)
    ROUTE(cuMemPoolGetAttribute) ROUTE(cuCtxSetCurrent) ROUTE(cuCtxGetCurrent) ROUTE(cuStreamCreate)
    ROUTE(cuCtxGetStreamPriorityRange) ROUTE(cuStreamCreateWithPriority)
    ROUTE(cuStreamGetCtx) ROUTE(cuStreamIsCapturing) ROUTE(cuEventCreate) ROUTE(cuEventElapsedTime) ROUTE(cuMemHostGetDevicePointer)
    ROUTE(cuMemHostAlloc) ROUTE(cuStreamWriteValue64) ROUTE(cuLaunchHostFunc) ROUTE(cuMemAllocAsync)
    ROUTE(cuMemFreeAsync) ROUTE(cuMemcpyHtoDAsync) ROUTE(cuMemcpyDtoHAsync) ROUTE(cuMemcpyDtoDAsync)
    ROUTE(cuMemcpyPeerAsync) ROUTE(cuMemsetD8Async) ROUTE(cuMemsetD16Async) ROUTE(cuMemsetD32Async)
    ROUTE(cuModuleLoadData) ROUTE(cuModuleGetFunction) ROUTE(cuModuleGetFunctionCount)
    ROUTE(cuStreamEndCapture) ROUTE(cuGraphGetNodes) ROUTE(cuGraphInstantiate)
    ROUTE(cuGraphInstantiateWithFlags) ROUTE(cuPointerGetAttribute) ROUTE(cuLaunchKernel)
    if (strncmp(symbol, "cuGetExportTable", 16) == 0) {  /* private tables: none here */
        *pfn = 0;
        if (status) *status = 1;
        return 500;
    }
    *pfn = (void *)ok;
done:
    if (status) *status = 0;
    return 0;
}
CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, u64 flags) {
    return cuGetProcAddress_v2(symbol, pfn, ver, flags, 0);
}
/* what gpuflow reaches through ctypes by name, and does nothing */
CUresult cuCtxSynchronize(void) { return 0; }
/* while standin_hold_events is set, the events recorded stay not ready (up
 * to 64 of them: the "GPU" is behind), until it is cleared; the waits on
 * events are counted */
int standin_hold_events = 0;
int standin_event_waits = 0;
static void *held[64];
static int n_held = 0;
CUresult cuEventRecord(void *e, void *s) {
    if (standin_hold_events && n_held < 64) held[n_held++] = e;
    return 0;
}
CUresult cuEventQuery(void *e) {
    if (!standin_hold_events) { n_held = 0; return 0; }
    for (int i = 0; i < n_held; i++) if (held[i] == e) return 600; /* NOT_READY */
    return 0;
}
CUresult cuStreamWaitEvent(void *s, void *e, unsigned f) { standin_event_waits++; return 0; }
CUresult cuStreamQuery(void *s) { return 0; }
CUresult cuStreamSynchronize(void *s) { return 0; }
/* every item enqueued so far is done: a wait for a value the word does not
 * hold yet waits for work never enqueued before it, which on a GPU hangs */
CUresult cuStreamWaitValue64_v2(void *s, u64 a, u64 v, unsigned f) {
    return *(volatile u64 *)(uintptr_t)a >= v ? 0 : 999; /* CUDA_ERROR_UNKNOWN */
}
CUresult cuGraphLaunch(void *e, void *s) { return 0; }
