/* funcmla launcher: run a fixed sequence of CUDA kernels in one foreign call.
 *
 * Built at first use with the system C compiler (interop/_launch.py) and loaded with ctypes.
 * It links against nothing: the address of the driver's cuLaunchKernel is stored in the
 * program by Python (taken from the libcuda that torch and JAX already loaded).
 *
 * Per call Python writes the stream, the kernel mask and the argument pointers into the
 * program's first words, then calls funcmla_run once; each kernel's parameter array points
 * at slots of the program, so no per-call marshalling happens here or in ctypes.
 *
 * funcmla_run_checked takes torch tensors instead of pointers: Python writes each argument's
 * TensorImpl address (`tensor._cdata`) into slots[0..num_args), and the argument checks
 * (dtype, shape, contiguity, device, alignment) run here through PyTorch's stable C shim
 * (`aoti_torch_get_*` in libtorch, whose tensor handle is a pointer to an at::Tensor, itself one
 * TensorImpl pointer), replacing each slot with the tensor's data pointer. Any mismatch
 * returns before any launch; Python then runs its own checks to name the argument. Python
 * verifies this reading against torch's own accessors on probe tensors before using it.
 * A kernel with a `host` function is a Mosaic GPU kernel: jaxlib compiled its module into device
 * code plus a host launch function that encodes the TMA descriptors from the buffer addresses
 * and launches the kernel on the stream; `function` then holds its context. `host_abi` says how
 * that function takes its arguments: 1 = host(context, stream, buffers) (jaxlib 0.11.2),
 * 2 = MLIR's packed C interface host({&context, &stream, &buffers}) (jaxlib 0.10.2).
 * The struct layout is mirrored by ctypes structures in _launch.py; funcmla_layout lets
 * Python verify the two agree before the first launch.
 */
#include <stddef.h>
#include <stdint.h>

#define FUNCMLA_MAX_KERNELS 64
#define FUNCMLA_MAX_PARAMS 32
#define FUNCMLA_MAX_SLOTS 128
#define FUNCMLA_MAX_ARGS 8
#define FUNCMLA_MAX_SHAPES 4
#define FUNCMLA_MAX_DIMS 4
#define FUNCMLA_BAD_ARGUMENT (-1)

typedef int32_t (*aoti_get_ptr)(void *tensor, void **ret);
typedef int32_t (*aoti_get_i64p)(void *tensor, int64_t **ret);
typedef int32_t (*aoti_get_i64)(void *tensor, int64_t *ret);
typedef int32_t (*aoti_get_i32)(void *tensor, int32_t *ret);

typedef struct { /* addresses of aoti_torch_get_* in libtorch */
  aoti_get_ptr data_ptr;
  aoti_get_i64p sizes;
  aoti_get_i64p strides;
  aoti_get_i64 dim;
  aoti_get_i32 dtype;
  aoti_get_i32 device_type;
  aoti_get_i32 device_index;
} funcmla_torch_api;

typedef struct { /* what one argument must be */
  int32_t dtype;
  int32_t device_type;
  int32_t device_index;
  int32_t num_shapes;
  uint64_t align_mask;
  int64_t ndim[FUNCMLA_MAX_SHAPES];
  int64_t shape[FUNCMLA_MAX_SHAPES][FUNCMLA_MAX_DIMS];
} funcmla_arg_spec;

typedef int (*funcmla_launch_fn)(void *function, unsigned grid_x, unsigned grid_y,
                                 unsigned grid_z, unsigned block_x, unsigned block_y,
                                 unsigned block_z, unsigned shared_mem_bytes, void *stream,
                                 void **params, void **extra);

typedef void (*funcmla_host_fn)(void **args);
typedef void (*funcmla_host_direct_fn)(void *context, void *stream, void **buffers);

typedef struct {
  void *function;                   /* CUfunction, or a Mosaic GPU kernel's context */
  void *host;                       /* NULL: cuLaunchKernel; else the Mosaic GPU launch */
  uint64_t host_abi;                /* 1: host(context, stream, buffers); 2: packed */
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t shared_mem_bytes;
  uint32_t num_params;
  void *params[FUNCMLA_MAX_PARAMS]; /* address of each parameter's value (a slot) */
} funcmla_kernel;

typedef struct {
  uint64_t stream;                  /* per call */
  uint64_t mask;                    /* per call: bit i set = launch kernel i */
  uint64_t slots[FUNCMLA_MAX_SLOTS]; /* per call (first ones) and fixed pointer values */
  funcmla_launch_fn launch;
  uint32_t num_kernels;
  int32_t failed_kernel;            /* index of the kernel whose launch failed, else -1 */
  funcmla_kernel kernels[FUNCMLA_MAX_KERNELS];
  funcmla_torch_api torch;
  uint32_t num_args;                /* funcmla_run_checked: slots[0..num_args) are tensors */
  int32_t bad_argument;             /* the argument a check refused, else -1 */
  funcmla_arg_spec args[FUNCMLA_MAX_ARGS];
} funcmla_program;

/* Launch every kernel whose mask bit is set, in order; stop at the first error and return
 * its CUresult (0: all launched). */
int funcmla_run(funcmla_program *p) {
  void *stream = (void *)(uintptr_t)p->stream;
  uint64_t mask = p->mask;
  p->failed_kernel = -1;
  for (uint32_t i = 0; i < p->num_kernels; ++i) {
    if (!((mask >> i) & 1u)) continue;
    funcmla_kernel *k = &p->kernels[i];
    if (k->host) {
      void *buffers[FUNCMLA_MAX_PARAMS];
      for (uint32_t j = 0; j < k->num_params; ++j) buffers[j] = *(void **)k->params[j];
      if (k->host_abi == 1) {
        ((funcmla_host_direct_fn)k->host)(k->function, stream, buffers);
      } else {
        void *context = k->function, *buffer_list = buffers, *st = stream;
        void *args[3] = {&context, &st, &buffer_list};
        ((funcmla_host_fn)k->host)(args);
      }
      continue;
    }
    int rc = p->launch(k->function, k->grid[0], k->grid[1], k->grid[2], k->block[0],
                       k->block[1], k->block[2], k->shared_mem_bytes, stream, k->params, NULL);
    if (rc != 0) {
      p->failed_kernel = (int32_t)i;
      return rc;
    }
  }
  return 0;
}

/* Read one tensor through the shim: 0 on success. `impl` is a TensorImpl address; a local
 * cell holding it is an at::Tensor borrowed for the call (no reference count changes). */
static int describe(const funcmla_torch_api *api, uint64_t impl, int32_t *dtype,
                    int32_t *device_type, int32_t *device_index, int64_t *ndim,
                    int64_t **sizes, int64_t **strides, void **data) {
  void *cell = (void *)(uintptr_t)impl;
  void *handle = &cell;
  if (impl == 0) return 1;
  if (api->dtype(handle, dtype) || api->device_type(handle, device_type) ||
      api->device_index(handle, device_index) || api->dim(handle, ndim) ||
      api->sizes(handle, sizes) || api->strides(handle, strides) ||
      api->data_ptr(handle, data))
    return 1;
  return 0;
}

static int check_argument(const funcmla_torch_api *api, const funcmla_arg_spec *spec,
                          uint64_t *slot) {
  int32_t dtype, device_type, device_index;
  int64_t ndim, *sizes, *strides;
  void *data;
  if (describe(api, *slot, &dtype, &device_type, &device_index, &ndim, &sizes, &strides,
               &data))
    return 1;
  if (dtype != spec->dtype || device_type != spec->device_type ||
      device_index != spec->device_index || ((uintptr_t)data & spec->align_mask))
    return 1;
  int shape_ok = 0;
  for (int32_t a = 0; a < spec->num_shapes && !shape_ok; ++a) {
    if (spec->ndim[a] != ndim) continue;
    shape_ok = 1;
    for (int64_t d = 0; d < ndim; ++d)
      if (sizes[d] != spec->shape[a][d]) shape_ok = 0;
  }
  if (!shape_ok) return 1;
  int64_t expected = 1; /* contiguous: row-major strides, size-1 dims free (torch's rule) */
  for (int64_t d = ndim - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return 1;
    expected *= sizes[d];
  }
  *slot = (uint64_t)(uintptr_t)data;
  return 0;
}

/* funcmla_run after checking the tensors in slots[0..num_args) (see the top of this file).
 * Returns FUNCMLA_BAD_ARGUMENT (bad_argument = its index) without launching anything when a
 * check fails, else as funcmla_run. */
int funcmla_run_checked(funcmla_program *p) {
  p->bad_argument = -1;
  for (uint32_t i = 0; i < p->num_args; ++i) {
    if (check_argument(&p->torch, &p->args[i], &p->slots[i])) {
      p->bad_argument = (int32_t)i;
      return FUNCMLA_BAD_ARGUMENT;
    }
  }
  return funcmla_run(p);
}

/* What the shim reports for the tensor at `impl`: out = {dtype, device type, device index,
 * ndim, data pointer, sizes[0..4), strides[0..4)}; returns nonzero if it could not read it.
 * Python compares this with torch's own accessors before trusting funcmla_run_checked. */
int funcmla_describe(const funcmla_torch_api *api, uint64_t impl, int64_t out[13]) {
  int32_t dtype, device_type, device_index;
  int64_t ndim, *sizes, *strides;
  void *data;
  if (describe(api, impl, &dtype, &device_type, &device_index, &ndim, &sizes, &strides,
               &data))
    return 1;
  out[0] = dtype;
  out[1] = device_type;
  out[2] = device_index;
  out[3] = ndim;
  out[4] = (int64_t)(uintptr_t)data;
  for (int64_t d = 0; d < FUNCMLA_MAX_DIMS; ++d) {
    out[5 + d] = d < ndim ? sizes[d] : 0;
    out[9 + d] = d < ndim ? strides[d] : 0;
  }
  return 0;
}

/* cuLaunchKernel's signature, launching nothing: a dry-run target that measures the host path
 * without the driver (bench/launcher.py). */
int funcmla_nop_launch(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                       unsigned block_x, unsigned block_y, unsigned block_z,
                       unsigned shared_mem_bytes, void *stream, void **params, void **extra) {
  (void)function; (void)grid_x; (void)grid_y; (void)grid_z; (void)block_x; (void)block_y;
  (void)block_z; (void)shared_mem_bytes; (void)stream; (void)params; (void)extra;
  return 0;
}

/* ---- step staging: a metadata program's inputs, then its graph ----------------------------
 * One call per SGLang step (interop/sglang/step_launch.py): up to FUNCMLA_MAX_COPIES device
 * copies of the step's index tensors into the program's static input buffer (a tensor of
 * int64 is read through its low 32-bit words, as a 2-D copy with an 8-byte source pitch), one
 * 32-bit memset writing the live batch size, then cuGraphLaunch of the program's instantiated
 * graph. All on one stream, nothing waits on the host. CUDA_MEMCPY2D is mirrored below. */
#define FUNCMLA_MAX_COPIES 4

typedef struct { /* CUDA_MEMCPY2D of cuda.h */
  size_t srcXInBytes, srcY;
  int32_t srcMemoryType;
  const void *srcHost;
  uint64_t srcDevice;
  void *srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int32_t dstMemoryType;
  void *dstHost;
  uint64_t dstDevice;
  void *dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
} funcmla_memcpy2d;

typedef int (*funcmla_memcpy2d_fn)(const funcmla_memcpy2d *copy, void *stream);
typedef int (*funcmla_memset32_fn)(uint64_t dst, uint32_t value, size_t count, void *stream);
typedef int (*funcmla_graph_launch_fn)(void *graph_exec, void *stream);

typedef struct {
  uint64_t stream;                        /* per call */
  uint64_t num_copies;                    /* per call */
  uint64_t live_value;                    /* per call: the word written at live_dst */
  uint64_t src[FUNCMLA_MAX_COPIES];       /* per call: source device pointers */
  uint64_t src_pitch[FUNCMLA_MAX_COPIES]; /* per call: bytes between source elements */
  uint64_t count[FUNCMLA_MAX_COPIES];     /* per call: 32-bit elements to copy */
  uint64_t dst[FUNCMLA_MAX_COPIES];       /* per call: destination device pointers */
  uint64_t live_dst;                      /* fixed: 0 = no memset */
  void *graph_exec;                       /* fixed: NULL = no graph launch */
  funcmla_memcpy2d_fn memcpy2d;           /* cuMemcpy2DAsync_v2 */
  funcmla_memset32_fn memset32;           /* cuMemsetD32Async */
  funcmla_graph_launch_fn graph_launch;   /* cuGraphLaunch */
  int32_t failed;                         /* 0..3: that copy, 4: the memset, 5: the graph */
} funcmla_stage;

/* Enqueue the copies, the memset and the graph; stop at the first error and return its
 * CUresult (0: all enqueued). */
int funcmla_stage_run(funcmla_stage *s) {
  void *stream = (void *)(uintptr_t)s->stream;
  s->failed = -1;
  for (uint64_t i = 0; i < s->num_copies && i < FUNCMLA_MAX_COPIES; ++i) {
    if (s->count[i] == 0) continue;
    funcmla_memcpy2d c = {0};
    c.srcMemoryType = 2; /* CU_MEMORYTYPE_DEVICE */
    c.dstMemoryType = 2;
    c.srcDevice = s->src[i];
    c.dstDevice = s->dst[i];
    if (s->src_pitch[i] == 4) { /* contiguous int32: one row */
      c.WidthInBytes = c.srcPitch = c.dstPitch = 4 * s->count[i];
      c.Height = 1;
    } else { /* strided or int64 source: one 4-byte row per element */
      c.WidthInBytes = 4;
      c.srcPitch = s->src_pitch[i];
      c.dstPitch = 4;
      c.Height = s->count[i];
    }
    int rc = s->memcpy2d(&c, stream);
    if (rc != 0) {
      s->failed = (int32_t)i;
      return rc;
    }
  }
  if (s->live_dst) {
    int rc = s->memset32(s->live_dst, (uint32_t)s->live_value, 1, stream);
    if (rc != 0) {
      s->failed = 4;
      return rc;
    }
  }
  if (s->graph_exec) {
    int rc = s->graph_launch(s->graph_exec, stream);
    if (rc != 0) {
      s->failed = 5;
      return rc;
    }
  }
  return 0;
}

/* sizeof(program), offsetof(kernels), sizeof(kernel), offsetof(launch), offsetof(torch),
 * offsetof(args), sizeof(arg_spec), sizeof(stage), sizeof(memcpy2d): checked against the ctypes mirror by Python. */
void funcmla_layout(uint64_t out[9]) {
  out[0] = sizeof(funcmla_program);
  out[1] = offsetof(funcmla_program, kernels);
  out[2] = sizeof(funcmla_kernel);
  out[3] = offsetof(funcmla_program, launch);
  out[4] = offsetof(funcmla_program, torch);
  out[5] = offsetof(funcmla_program, args);
  out[6] = sizeof(funcmla_arg_spec);
  out[7] = sizeof(funcmla_stage);
  out[8] = sizeof(funcmla_memcpy2d);
}
