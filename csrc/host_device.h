// SHARDADAM_HOST_DEVICE marks code compiled for the CPU and, under nvcc, for the
// GPU too: the formula, the codecs and the dtype rules the CUDA kernels share
// with the CPU core and its tests.
#ifndef SHARDADAM_HOST_DEVICE_H_
#define SHARDADAM_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define SHARDADAM_HOST_DEVICE __host__ __device__
#else
#define SHARDADAM_HOST_DEVICE
#endif

#endif  // SHARDADAM_HOST_DEVICE_H_
