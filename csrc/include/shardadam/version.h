// The version of the shardadam headers, the one place it is written: CMake's
// project() and the Python package's metadata read these three lines.
// shardadam::Version() (adam.h) says which version the linked library was built
// as, so a program can tell a mixed install (headers of one, archive of another).
#ifndef SHARDADAM_VERSION_H_
#define SHARDADAM_VERSION_H_

#define SHARDADAM_VERSION_MAJOR 0
#define SHARDADAM_VERSION_MINOR 1
#define SHARDADAM_VERSION_PATCH 0

// One number for preprocessor comparisons: 0.1.0 is 100, 1.2.3 is 10203.
#define SHARDADAM_VERSION \
  (SHARDADAM_VERSION_MAJOR * 10000 + SHARDADAM_VERSION_MINOR * 100 + SHARDADAM_VERSION_PATCH)

#define SHARDADAM_VERSION_STR_(x) #x
#define SHARDADAM_VERSION_STR(x) SHARDADAM_VERSION_STR_(x)
// "MAJOR.MINOR.PATCH".
#define SHARDADAM_VERSION_STRING                                      \
  SHARDADAM_VERSION_STR(SHARDADAM_VERSION_MAJOR)                      \
  "." SHARDADAM_VERSION_STR(SHARDADAM_VERSION_MINOR) "." SHARDADAM_VERSION_STR( \
      SHARDADAM_VERSION_PATCH)

#endif  // SHARDADAM_VERSION_H_
