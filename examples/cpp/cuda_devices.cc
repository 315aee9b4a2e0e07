// Prints what the CUDA backend of the installed package sees: linking it is
// all a program needs (the CUDA runtime is in the archive), GPU or not.
#include <cstdio>

#include "shardadam/adam_cuda.h"

int main() {
  const int devices = shardadam::CudaDeviceCount();
  std::printf("CUDA backend: kernels for %s; %d device(s)\n",
              shardadam::CudaArchitectures(), devices);
  for (int d = 0; d < devices; ++d) {
    std::printf("  device %d: %s\n", d,
                shardadam::CudaKernelsRunOn(d) ? "kernels run" : "no kernels for it");
  }
  return 0;
}
