# Each installed public header, compiled alone as strict C++17 with warnings as
# errors, the strict ones a user's build may turn on included (a header cannot
# control its includer's flags): it must include what it uses, warn about nothing, and never pull in
# Highway (a private detail of the library). One generated file per header, so
# a header added later is checked without a change here.
get_target_property(SHARDADAM_INCLUDE_DIRS shardadam::core INTERFACE_INCLUDE_DIRECTORIES)
file(GLOB SHARDADAM_PUBLIC_HEADERS LIST_DIRECTORIES false
     "${SHARDADAM_INCLUDE_DIRS}/shardadam/*.h")
if(NOT SHARDADAM_PUBLIC_HEADERS)
  message(FATAL_ERROR "no public headers under ${SHARDADAM_INCLUDE_DIRS}/shardadam")
endif()

set(HEADER_CHECK_SOURCES)
foreach(header ${SHARDADAM_PUBLIC_HEADERS})
  get_filename_component(name "${header}" NAME)
  get_filename_component(stem "${header}" NAME_WE)
  set(source "${CMAKE_CURRENT_BINARY_DIR}/header_check/${stem}.cc")
  # HIGHWAY_HWY_BASE_H_ guards hwy/base.h, which every Highway header includes.
  file(CONFIGURE OUTPUT "${source}" CONTENT "#include <shardadam/${name}>
#ifdef HIGHWAY_HWY_BASE_H_
#error \"shardadam/${name} includes Highway\"
#endif
")
  list(APPEND HEADER_CHECK_SOURCES "${source}")
endforeach()

add_library(public_headers OBJECT ${HEADER_CHECK_SOURCES})
target_link_libraries(public_headers PRIVATE shardadam::core)
target_compile_options(public_headers PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wconversion
                       -Wsign-conversion -Wswitch-enum -Wold-style-cast -Wundef -Wcast-qual
                       -Wdouble-promotion -Werror)
# An imported target's include directories are system directories by default,
# where the compiler mutes warnings; the headers are what is checked here.
set_target_properties(public_headers PROPERTIES NO_SYSTEM_FROM_IMPORTED ON)
