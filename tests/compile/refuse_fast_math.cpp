// Compiled by the ctest refuses_fast_math with -ffast-math: must fail with k3/config.hpp's #error.
#include "k3/config.hpp"

int main() { return 0; }
