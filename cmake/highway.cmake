# Google Highway, for the core's kernels and the tests: the target shardadam_hwy
# (headers, definitions and the library to link).
#
# SHARDADAM_HWY selects how Highway's small runtime library (CPU target
# detection) is linked:
#   shared  the system's libhwy through pkg-config (Debian's libhwy-dev). The
#           default for C++ builds and the Makefile's developer install: nothing
#           to download or compile, and the installed CMake package finds it too.
#   static  linked into the core, so that shardadam._C needs only the C/C++
#           runtime at run time. The default for the Python package (SKBUILD).
#           Taken, in order, from SHARDADAM_HWY_SOURCE_DIR (a Highway source
#           tree), a static libhwy.a found on the system, or the pinned source
#           release downloaded from Debian's archive. Debian ships no libhwy.a.
#
# Sets SHARDADAM_HWY_PACKAGE for the installed package's config: what an archive
# of the core still needs to link (hwy::hwy, a libhwy.a path, or nothing when
# Highway's objects are in the archive).
if(SKBUILD)
  set(_shardadam_hwy_default static)
else()
  set(_shardadam_hwy_default shared)
endif()
set(SHARDADAM_HWY "${_shardadam_hwy_default}" CACHE STRING
    "How to link Google Highway: shared (system libhwy) or static (linked into the core)")
set_property(CACHE SHARDADAM_HWY PROPERTY STRINGS shared static)
set(SHARDADAM_HWY_SOURCE_DIR "" CACHE PATH
    "Highway source tree built as a static library when SHARDADAM_HWY=static")

# The release pinned for static builds: the same Highway as Debian 12's
# libhwy-dev, so both kinds of build compile the same kernels.
set(SHARDADAM_HWY_VERSION 1.0.3)
set(SHARDADAM_HWY_URL
    "https://deb.debian.org/debian/pool/main/h/highway/highway_${SHARDADAM_HWY_VERSION}.orig.tar.gz")
set(SHARDADAM_HWY_SHA256 566fc77315878473d9a6bd815f7de78c73734acdcb745c3dde8579560ac5440e)

add_library(shardadam_hwy INTERFACE)

if(SHARDADAM_HWY STREQUAL "shared")
  find_package(PkgConfig REQUIRED)
  # GLOBAL: the tests' directory links it too.
  pkg_check_modules(HWY REQUIRED IMPORTED_TARGET GLOBAL libhwy)
  target_link_libraries(shardadam_hwy INTERFACE PkgConfig::HWY)
  set(SHARDADAM_HWY_PACKAGE "hwy::hwy")
  message(STATUS "shardadam: Highway ${HWY_VERSION}, shared (system)")
elseif(SHARDADAM_HWY STREQUAL "static")
  if(NOT SHARDADAM_HWY_SOURCE_DIR)
    find_library(SHARDADAM_HWY_STATIC_LIBRARY NAMES libhwy.a)
  endif()
  if(NOT SHARDADAM_HWY_SOURCE_DIR AND SHARDADAM_HWY_STATIC_LIBRARY)
    # Headers installed beside the archive (<prefix>/lib[/<arch>]/libhwy.a).
    get_filename_component(_hwy_libdir "${SHARDADAM_HWY_STATIC_LIBRARY}" DIRECTORY)
    find_path(SHARDADAM_HWY_INCLUDE_DIR hwy/highway.h
              HINTS "${_hwy_libdir}/../include" "${_hwy_libdir}/../../include" REQUIRED)
    target_include_directories(shardadam_hwy INTERFACE "${SHARDADAM_HWY_INCLUDE_DIR}")
    target_compile_definitions(shardadam_hwy INTERFACE HWY_STATIC_DEFINE)
    target_link_libraries(shardadam_hwy INTERFACE "${SHARDADAM_HWY_STATIC_LIBRARY}")
    set(SHARDADAM_HWY_PACKAGE "${SHARDADAM_HWY_STATIC_LIBRARY}")
    message(STATUS "shardadam: Highway static, ${SHARDADAM_HWY_STATIC_LIBRARY}")
  else()
    if(NOT SHARDADAM_HWY_SOURCE_DIR)
      include(FetchContent)
      # Extracted files dated now, so that a new download rebuilds what used them.
      if(POLICY CMP0135)
        cmake_policy(SET CMP0135 NEW)
      endif()
      FetchContent_Declare(shardadam_highway
        URL "${SHARDADAM_HWY_URL}"
        URL_HASH SHA256=${SHARDADAM_HWY_SHA256})
      FetchContent_GetProperties(shardadam_highway)
      if(NOT shardadam_highway_POPULATED)
        message(STATUS "shardadam: downloading Highway ${SHARDADAM_HWY_VERSION} from ${SHARDADAM_HWY_URL}")
        FetchContent_Populate(shardadam_highway)
      endif()
      set(_hwy_source "${shardadam_highway_SOURCE_DIR}")
    else()
      set(_hwy_source "${SHARDADAM_HWY_SOURCE_DIR}")
    endif()
    if(NOT EXISTS "${_hwy_source}/hwy/highway.h")
      message(FATAL_ERROR "SHARDADAM_HWY_SOURCE_DIR: no Highway source in '${_hwy_source}'")
    endif()
    # Only the static runtime library: no tests, contrib, examples or install
    # rules. EXCLUDE_FROM_ALL builds just what the core depends on.
    set(HWY_FORCE_STATIC_LIBS ON CACHE BOOL "" FORCE)
    set(HWY_ENABLE_TESTS OFF CACHE BOOL "" FORCE)
    set(HWY_ENABLE_CONTRIB OFF CACHE BOOL "" FORCE)
    set(HWY_ENABLE_EXAMPLES OFF CACHE BOOL "" FORCE)
    set(HWY_ENABLE_INSTALL OFF CACHE BOOL "" FORCE)
    add_subdirectory("${_hwy_source}" "${PROJECT_BINARY_DIR}/highway" EXCLUDE_FROM_ALL)
    # Highway builds it with hidden visibility: nothing of it is exported from
    # _C, so another Highway in the same process cannot interpose.
    target_link_libraries(shardadam_hwy INTERFACE hwy)
    # The core's archive carries Highway's objects (see csrc/), so the installed
    # package needs no Highway at all.
    set(SHARDADAM_HWY_BUNDLED_OBJECTS "$<TARGET_OBJECTS:hwy>")
    set(SHARDADAM_HWY_PACKAGE "")
    message(STATUS "shardadam: Highway static, built from ${_hwy_source}")
  endif()
else()
  message(FATAL_ERROR "SHARDADAM_HWY must be shared or static; got '${SHARDADAM_HWY}'")
endif()
