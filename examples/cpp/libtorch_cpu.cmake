# LibTorch's CPU libraries as the target `libtorch_cpu`, from LIBTORCH_ROOT: a
# directory laid out as LibTorch is (include/, lib/), which the pip-installed
# torch package is too. LibTorch's own package (find_package(Torch)) is not used:
# for a torch built with CUDA (the default pip wheel on Linux) it stops unless a
# CUDA toolkit is installed, and it links CUDA libraries this CPU program never
# calls. Assumes the C++11 ABI of libstdc++ (GCC's default), as torch >= 2.7
# wheels are built with.
find_library(LIBTORCH_TORCH_CPU torch_cpu PATHS "${LIBTORCH_ROOT}/lib" NO_DEFAULT_PATH REQUIRED)
find_library(LIBTORCH_C10 c10 PATHS "${LIBTORCH_ROOT}/lib" NO_DEFAULT_PATH REQUIRED)
add_library(libtorch_cpu INTERFACE)
# SYSTEM: LibTorch's own warnings are not this project's to fix.
target_include_directories(libtorch_cpu SYSTEM INTERFACE
  "${LIBTORCH_ROOT}/include"
  "${LIBTORCH_ROOT}/include/torch/csrc/api/include")
target_link_libraries(libtorch_cpu INTERFACE "${LIBTORCH_TORCH_CPU}" "${LIBTORCH_C10}")
