// graph kernels (to be filled in by the graph work; see native/common.h for conventions).
#include "common.h"

PYBIND11_MODULE(_native_graph, m) {
    hpcgnn::add_thread_control(m);
}
