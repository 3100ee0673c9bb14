/* funcmla launcher: run a fixed sequence of CUDA kernels in one foreign call.
 *
 * Built at first use with the system C compiler (interop/_launch.py) and loaded with ctypes.
 * It links against nothing: the address of the driver's cuLaunchKernel is stored in the
 * program by Python (taken from the libcuda that torch and JAX already loaded).
 *
 * Per call Python writes the stream, the kernel mask and the argument pointers into the
 * program's first words, then calls funcmla_run once; each kernel's parameter array points
 * at slots of the program, so no per-call marshalling happens here or in ctypes.
 * The struct layout is mirrored by ctypes structures in _launch.py; funcmla_layout lets
 * Python verify the two agree before the first launch.
 */
#include <stddef.h>
#include <stdint.h>

#define FUNCMLA_MAX_KERNELS 8
#define FUNCMLA_MAX_PARAMS 16
#define FUNCMLA_MAX_SLOTS 32

typedef int (*funcmla_launch_fn)(void *function, unsigned grid_x, unsigned grid_y,
                                 unsigned grid_z, unsigned block_x, unsigned block_y,
                                 unsigned block_z, unsigned shared_mem_bytes, void *stream,
                                 void **params, void **extra);

typedef struct {
  void *function;
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
    int rc = p->launch(k->function, k->grid[0], k->grid[1], k->grid[2], k->block[0],
                       k->block[1], k->block[2], k->shared_mem_bytes, stream, k->params, NULL);
    if (rc != 0) {
      p->failed_kernel = (int32_t)i;
      return rc;
    }
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

/* sizeof(program), offsetof(kernels), sizeof(kernel), offsetof(launch): checked by Python. */
void funcmla_layout(uint64_t out[4]) {
  out[0] = sizeof(funcmla_program);
  out[1] = offsetof(funcmla_program, kernels);
  out[2] = sizeof(funcmla_kernel);
  out[3] = offsetof(funcmla_program, launch);
}
