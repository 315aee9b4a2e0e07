# `cmake --install` of the C++ core: public headers, the static libraries and a
# CMake package, so that a C++ project gets them with
#   find_package(shardadam CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE shardadam::core)   # shardadam::cuda for GPUs
# The package's config (shardadam-config.cmake.in) also names what the archives
# still need from the system at link time.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(SHARDADAM_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/shardadam")

# Only the public headers: everything else in csrc/ (Highway's kernels among it)
# is compiled into the archives; adam_cuda.h only where its backend is.
if(SHARDADAM_ENABLE_CUDA)
  set(_shardadam_without_cuda_header "")
else()
  set(_shardadam_without_cuda_header PATTERN "adam_cuda.h" EXCLUDE)
endif()
install(DIRECTORY "${PROJECT_SOURCE_DIR}/csrc/include/shardadam"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.h" ${_shardadam_without_cuda_header})

# Consumers compile the headers as C++17 (inline variables).
target_compile_features(shardadam_core INTERFACE cxx_std_17)
set(SHARDADAM_INSTALLED_TARGETS shardadam_core)
set_target_properties(shardadam_core PROPERTIES EXPORT_NAME core)
if(SHARDADAM_ENABLE_CUDA)
  list(APPEND SHARDADAM_INSTALLED_TARGETS shardadam_cuda)
  set_target_properties(shardadam_cuda PROPERTIES EXPORT_NAME cuda)
endif()
install(TARGETS ${SHARDADAM_INSTALLED_TARGETS}
        EXPORT shardadam-targets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(EXPORT shardadam-targets
        NAMESPACE shardadam::
        DESTINATION "${SHARDADAM_CMAKE_DIR}")

# Written below the build tree's root, in a folder find_package never searches: the
# config works only installed (beside shardadam-targets.cmake), and a project pointed at
# the build tree would find a package that fails.
set(_shardadam_staged "${PROJECT_BINARY_DIR}/install-staging")
configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/shardadam-config.cmake.in"
  "${_shardadam_staged}/shardadam-config.cmake"
  INSTALL_DESTINATION "${SHARDADAM_CMAKE_DIR}")
# 0.x: a minor release may change the API, so only the same minor version matches.
write_basic_package_version_file(
  "${_shardadam_staged}/shardadam-config-version.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMinorVersion)
install(FILES "${_shardadam_staged}/shardadam-config.cmake"
              "${_shardadam_staged}/shardadam-config-version.cmake"
        DESTINATION "${SHARDADAM_CMAKE_DIR}")
unset(_shardadam_staged)

# The licence, and the notices of what the archives and the extension take in.
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" "${PROJECT_SOURCE_DIR}/THIRD_PARTY_NOTICES.md"
        DESTINATION "${CMAKE_INSTALL_DOCDIR}")
