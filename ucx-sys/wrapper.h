/* The UCX API moe-node binds: ucp (protocols) and the ucs status helpers it returns. */
#include <ucp/api/ucp.h>
