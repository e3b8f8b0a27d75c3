// cuda_runtime.h for g++: everything CUDA C++ kernels use here is in simt.h (utils/simt.py puts this folder first on
// the include path).
#pragma once
#include "simt.h"
