# Cross build for 64-bit Arm Linux with Debian's cross compiler
# (g++-aarch64-linux-gnu) against arm64 libraries installed through multiarch
# (libhwy-dev:arm64, libgtest-dev:arm64 under /usr/lib/aarch64-linux-gnu).
# Test executables run under qemu-user; qemu-aarch64 reads the CPU model
# (QEMU_CPU) from the environment, so one build serves every vector length.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Only the arm64 .pc files: the host's would hand out x86-64 libhwy.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")

# gtest_discover_tests and ctest start the tests through this. The arm64
# dynamic loader and libraries are multiarch paths of this system, so qemu
# needs no separate root (-L).
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
