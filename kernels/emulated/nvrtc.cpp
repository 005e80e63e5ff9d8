// The emulated NVRTC (soname libnvrtc.so): "compiles" a kernel file by building it with g++
// for the emulated CUDA device (driver.cpp), and hands back an image that is the source
// itself behind a marker, which the emulated cuModuleLoadData takes. Compile errors come
// back as NVRTC's do: NVRTC_ERROR_COMPILATION and the compiler's log.

#include <cstdlib>
#include <cstring>
#include <string>

extern "C" int moe_emu_build(const char* source, char** log);
extern "C" const char* moe_emu_image_magic();

namespace {

struct Program {
    std::string source;
    std::string log;
    std::string image;
};

enum : int { SUCCESS = 0, INVALID_INPUT = 3, INVALID_PROGRAM = 4, COMPILATION = 6 };

}  // namespace

extern "C" {

int nvrtcVersion(int* major, int* minor) {
    *major = 13;
    *minor = 0;
    return SUCCESS;
}

int nvrtcGetNumSupportedArchs(int* count) {
    *count = 1;
    return SUCCESS;
}

int nvrtcGetSupportedArchs(int* archs) {
    archs[0] = 90;
    return SUCCESS;
}

const char* nvrtcGetErrorString(int result) {
    switch (result) {
        case SUCCESS: return "NVRTC_SUCCESS";
        case INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
        case INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
        case COMPILATION: return "NVRTC_ERROR_COMPILATION";
        default: return "NVRTC_ERROR";
    }
}

int nvrtcCreateProgram(void** program, const char* source, const char*, int, const char* const*,
                       const char* const*) {
    if (!program || !source) return INVALID_INPUT;
    *program = new Program{source, "", ""};
    return SUCCESS;
}

int nvrtcDestroyProgram(void** program) {
    if (!program || !*program) return INVALID_PROGRAM;
    delete static_cast<Program*>(*program);
    *program = nullptr;
    return SUCCESS;
}

int nvrtcCompileProgram(void* program, int, const char* const*) {
    Program* p = static_cast<Program*>(program);
    if (!p) return INVALID_PROGRAM;
    char* log = nullptr;
    int failed = moe_emu_build(p->source.c_str(), &log);
    p->log = log ? log : "";
    free(log);
    if (failed) return COMPILATION;
    p->image = std::string(moe_emu_image_magic()) + p->source;
    return SUCCESS;
}

int nvrtcGetCUBINSize(void* program, size_t* size) {
    Program* p = static_cast<Program*>(program);
    if (!p || p->image.empty()) return INVALID_PROGRAM;
    *size = p->image.size() + 1;
    return SUCCESS;
}

int nvrtcGetCUBIN(void* program, char* out) {
    Program* p = static_cast<Program*>(program);
    if (!p || p->image.empty()) return INVALID_PROGRAM;
    memcpy(out, p->image.c_str(), p->image.size() + 1);
    return SUCCESS;
}

int nvrtcGetPTXSize(void* program, size_t* size) { return nvrtcGetCUBINSize(program, size); }

int nvrtcGetPTX(void* program, char* out) { return nvrtcGetCUBIN(program, out); }

int nvrtcGetProgramLogSize(void* program, size_t* size) {
    Program* p = static_cast<Program*>(program);
    if (!p) return INVALID_PROGRAM;
    *size = p->log.size() + 1;
    return SUCCESS;
}

int nvrtcGetProgramLog(void* program, char* out) {
    Program* p = static_cast<Program*>(program);
    if (!p) return INVALID_PROGRAM;
    memcpy(out, p->log.c_str(), p->log.size() + 1);
    return SUCCESS;
}

}  // extern "C"
