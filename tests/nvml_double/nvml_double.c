/*
 * TEST DOUBLE of libnvidia-ml.so.1 (NVIDIA Management Library).
 *
 * Not NVIDIA code and not for production: the tests build it as
 * libnvidia-ml.so.1 in a temporary directory and run the agent with
 * LD_LIBRARY_PATH pointing there, so the real nvidia-ml-py bindings (pynvml)
 * load it exactly as they load the driver's library. It implements only the
 * NVML functions the agent calls, with the C signatures of nvml.h, and answers
 * from the fixture file named by the environment variable NVML_DOUBLE_FIXTURE.
 *
 * Fixture format: one "key=value" per line, '#' starts a comment, later lines win.
 *   init_error=9                     nvmlInit returns this code
 *   driver_version=570.124.06  nvml_version=12.570.124.06  cuda_driver_version=12080
 *   device_count=8
 *   fabric_max_version=3             highest nvmlGpuFabricInfo struct version accepted (2 or 3)
 *   gpu.<i|*>.<field>=<value>        per GPU ('*' = every GPU); fields below
 *   gpu.<i|*>.fail.<nvmlFunction>=<code>   that function returns <code> for that GPU
 * GPU fields: handle_error error name uuid serial bus_id pci_device_id minor
 *   pcie_curr_gen pcie_max_gen pcie_gpu_max_gen pcie_curr_width pcie_max_width
 *   ecc_current ecc_pending ecc_volatile_uncorrected
 *   remap_corr remap_unc remap_pending remap_failure retired_sbe retired_dbe retired_pending
 *   persistence mig_current mig_pending temperature clocks_event_reasons
 *   fabric_state fabric_status fabric_clique fabric_cluster_uuid (32 hex) fabric_health_mask
 *   inforom_error                    nvmlDeviceValidateInforom returns this code (14 = CORRUPTED_INFOROM)
 *   recovery_action                  field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230): 0 NONE, 1 GPU_RESET,
 *                                    2 NODE_REBOOT, 3 DRAIN_P2P, 4 DRAIN_AND_RESET
 *   nvlink_count                     field NVML_FI_DEV_NVLINK_LINK_COUNT (91); links >= it answer NOT_SUPPORTED
 *   nvlink_down=0,5                  these links are inactive (every other link < nvlink_count is active)
 *   field_error.<fieldId>=<code>     nvmlDeviceGetFieldValues puts <code> in that field's nvmlReturn
 *                                    (an older driver that does not know the field); unknown fields
 *                                    answer NOT_SUPPORTED there
 *   compute_procs=pid:bytes,...      nvmlDeviceGetComputeRunningProcesses_v3 (at most 16)
 *   graphics_procs=pid:bytes,...     nvmlDeviceGetGraphicsRunningProcesses_v3 (at most 16)
 * "handle_error" fails nvmlDeviceGetHandleByIndex_v2; "error" fails every query on the GPU.
 * Structures have the layout of nvml.h (and of pynvml's ctypes structures; the _Static_asserts
 * below are checked against them by tests/gpu/test_nvml.py).
 * If NVML_DOUBLE_CALL_LOG names a file, nvmlInitWithFlags and nvmlShutdown append their names to it,
 * so tests can see how often the agent initialises NVML.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 64
#define MAX_FAILS 16
#define MAX_PROCS 16
#define MAX_FIELD_ERRORS 8
#define STR 96
#define NVML_NVLINK_MAX_LINKS 36
#define NVML_FI_DEV_NVLINK_LINK_COUNT 91
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
#define NVML_VALUE_TYPE_UNSIGNED_INT 1

struct proc {
    unsigned int pid;
    unsigned long long used;
};

struct nvmlDevice_st {
    int index;
    int handle_error, error;
    char name[STR], uuid[STR], serial[STR], bus_id[STR];
    unsigned int pci_device_id, minor;
    unsigned int pcie_curr_gen, pcie_max_gen, pcie_gpu_max_gen, pcie_curr_width, pcie_max_width;
    unsigned int ecc_current, ecc_pending;
    unsigned long long ecc_volatile_uncorrected;
    unsigned int remap_corr, remap_unc, remap_pending, remap_failure;
    unsigned int retired_sbe, retired_dbe, retired_pending;
    unsigned int persistence, mig_current, mig_pending;
    int temperature;
    unsigned long long clocks_event_reasons;
    unsigned int fabric_state, fabric_status, fabric_clique, fabric_health_mask;
    unsigned char fabric_cluster_uuid[16];
    int inforom_error;
    unsigned int recovery_action, nvlink_count;
    unsigned char nvlink_down[NVML_NVLINK_MAX_LINKS];
    int nfield_errors;
    unsigned int field_error_id[MAX_FIELD_ERRORS];
    int field_error_code[MAX_FIELD_ERRORS];
    int ncompute, ngraphics;
    struct proc compute[MAX_PROCS], graphics[MAX_PROCS];
    int nfails;
    char fail_fn[MAX_FAILS][64];
    int fail_code[MAX_FAILS];
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version;
    int sensorType;
    int temperature;
} nvmlTemperature_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
    unsigned char healthSummary; /* v3 only */
} nvmlGpuFabricInfoV_t;

/* nvml.h nvmlValue_t / nvmlFieldValue_t (pynvml: c_nvmlValue_t, c_nvmlFieldValue_t) */
typedef union {
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType; /* nvmlValueType_t */
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

/* nvml.h nvmlProcessInfo_t, the v2/v3 layout (pynvml: c_nvmlProcessInfo_v2_t = c_nvmlProcessInfo_v3_t) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t size");
_Static_assert(offsetof(nvmlFieldValue_t, timestamp) == 8, "nvmlFieldValue_t.timestamp offset");
_Static_assert(offsetof(nvmlFieldValue_t, valueType) == 24, "nvmlFieldValue_t.valueType offset");
_Static_assert(offsetof(nvmlFieldValue_t, nvmlReturn) == 28, "nvmlFieldValue_t.nvmlReturn offset");
_Static_assert(offsetof(nvmlFieldValue_t, value) == 32, "nvmlFieldValue_t.value offset");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t size");
_Static_assert(offsetof(nvmlProcessInfo_t, usedGpuMemory) == 8, "nvmlProcessInfo_t.usedGpuMemory offset");
_Static_assert(offsetof(nvmlProcessInfo_t, computeInstanceId) == 20, "nvmlProcessInfo_t.computeInstanceId offset");

#define FABRIC_V2 0x02000024u
#define FABRIC_V3 0x03000028u
#define TEMPERATURE_V1 0x0100000Cu

static struct nvmlDevice_st gpus[MAX_GPUS];
static int initialised, loaded, device_count, init_error, fabric_max_version = 3, cuda_driver_version;
static char driver_version[STR], nvml_version[STR];

static void copy(char *dst, const char *src) { snprintf(dst, STR, "%s", src); }

/* "pid:bytes,pid:bytes" */
static int set_procs(struct proc *procs, const char *v) {
    int n = 0;
    const char *p = v;
    while (*p && n < MAX_PROCS) {
        char *end;
        unsigned long pid = strtoul(p, &end, 0);
        if (end == p) break;
        procs[n].pid = (unsigned int)pid;
        procs[n].used = *end == ':' ? strtoull(end + 1, &end, 0) : 0;
        n++;
        p = *end == ',' ? end + 1 : end;
    }
    return n;
}

/* "0,5": these links are down */
static void set_links_down(unsigned char *down, const char *v) {
    memset(down, 0, NVML_NVLINK_MAX_LINKS);
    const char *p = v;
    while (*p) {
        char *end;
        unsigned long link = strtoul(p, &end, 0);
        if (end == p) break;
        if (link < NVML_NVLINK_MAX_LINKS) down[link] = 1;
        p = *end == ',' ? end + 1 : end;
    }
}

static void set_gpu(struct nvmlDevice_st *g, const char *field, const char *v) {
    unsigned long long n = strtoull(v, NULL, 0);
    if (!strncmp(field, "fail.", 5)) {
        if (g->nfails < MAX_FAILS) {
            snprintf(g->fail_fn[g->nfails], 64, "%s", field + 5);
            g->fail_code[g->nfails++] = (int)n;
        }
    } else if (!strncmp(field, "field_error.", 12)) {
        if (g->nfield_errors < MAX_FIELD_ERRORS) {
            g->field_error_id[g->nfield_errors] = (unsigned int)strtoul(field + 12, NULL, 0);
            g->field_error_code[g->nfield_errors++] = (int)n;
        }
    } else if (!strcmp(field, "compute_procs")) g->ncompute = set_procs(g->compute, v);
    else if (!strcmp(field, "graphics_procs")) g->ngraphics = set_procs(g->graphics, v);
    else if (!strcmp(field, "nvlink_down")) set_links_down(g->nvlink_down, v);
#define NUM(f) else if (!strcmp(field, #f)) g->f = (n)
#define TXT(f) else if (!strcmp(field, #f)) copy(g->f, v)
    NUM(handle_error); NUM(error); TXT(name); TXT(uuid); TXT(serial); TXT(bus_id);
    NUM(pci_device_id); NUM(minor); NUM(pcie_curr_gen); NUM(pcie_max_gen); NUM(pcie_gpu_max_gen);
    NUM(pcie_curr_width); NUM(pcie_max_width); NUM(ecc_current); NUM(ecc_pending);
    NUM(ecc_volatile_uncorrected); NUM(remap_corr); NUM(remap_unc); NUM(remap_pending);
    NUM(remap_failure); NUM(retired_sbe); NUM(retired_dbe); NUM(retired_pending); NUM(persistence);
    NUM(mig_current); NUM(mig_pending); NUM(clocks_event_reasons); NUM(fabric_state);
    NUM(fabric_status); NUM(fabric_clique); NUM(fabric_health_mask); NUM(inforom_error);
    NUM(recovery_action); NUM(nvlink_count);
#undef NUM
#undef TXT
    else if (!strcmp(field, "temperature")) g->temperature = (int)strtol(v, NULL, 0);
    else if (!strcmp(field, "fabric_cluster_uuid")) {
        for (int i = 0; i < 16 && v[2 * i] && v[2 * i + 1]; i++) {
            char byte[3] = {v[2 * i], v[2 * i + 1], 0};
            g->fabric_cluster_uuid[i] = (unsigned char)strtoul(byte, NULL, 16);
        }
    } else
        fprintf(stderr, "nvml test double: unknown GPU field %s\n", field);
}

static int load(void) {
    const char *path = getenv("NVML_DOUBLE_FIXTURE");
    if (!path) {
        fprintf(stderr, "nvml test double: NVML_DOUBLE_FIXTURE is not set\n");
        return NVML_ERROR_UNKNOWN;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "nvml test double: cannot open %s\n", path);
        return NVML_ERROR_UNKNOWN;
    }
    memset(gpus, 0, sizeof gpus);
    for (int i = 0; i < MAX_GPUS; i++) gpus[i].index = i;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        const char *key = line, *v = eq + 1;
        while (*key == ' ') key++;
        if (!strcmp(key, "init_error")) init_error = atoi(v);
        else if (!strcmp(key, "driver_version")) copy(driver_version, v);
        else if (!strcmp(key, "nvml_version")) copy(nvml_version, v);
        else if (!strcmp(key, "cuda_driver_version")) cuda_driver_version = atoi(v);
        else if (!strcmp(key, "device_count")) device_count = atoi(v);
        else if (!strcmp(key, "fabric_max_version")) fabric_max_version = atoi(v);
        else if (!strncmp(key, "gpu.", 4)) {
            const char *sel = key + 4, *dot = strchr(sel, '.');
            if (!dot) continue;
            if (*sel == '*') {
                for (int i = 0; i < MAX_GPUS; i++) set_gpu(&gpus[i], dot + 1, v);
            } else {
                int i = atoi(sel);
                if (i >= 0 && i < MAX_GPUS) set_gpu(&gpus[i], dot + 1, v);
            }
        } else
            fprintf(stderr, "nvml test double: unknown key %s\n", key);
    }
    fclose(f);
    if (device_count > MAX_GPUS) device_count = MAX_GPUS;
    loaded = 1;
    return NVML_SUCCESS;
}

static void log_call(const char *fn) {
    const char *path = getenv("NVML_DOUBLE_CALL_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s\n", fn);
    fclose(f);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    log_call(__func__);
    if (!loaded) {
        int rc = load();
        if (rc) return rc;
    }
    if (init_error) return init_error;
    initialised++;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) {
    log_call(__func__);
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t out_str(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

static nvmlReturn_t guard(nvmlDevice_t d, const char *fn) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (d < gpus || d >= gpus + device_count) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->error) return d->error;
    for (int i = 0; i < d->nfails; i++)
        if (!strcmp(d->fail_fn[i], fn)) return d->fail_code[i];
    return NVML_SUCCESS;
}
#define GUARD(d) do { nvmlReturn_t rc_ = guard((d), __func__); if (rc_) return rc_; } while (0)
#define UINT_GETTER(fn, field) \
    nvmlReturn_t fn(nvmlDevice_t d, unsigned int *out) { GUARD(d); *out = d->field; return NVML_SUCCESS; }

nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    return out_str(v, len, driver_version);
}
nvmlReturn_t nvmlSystemGetNVMLVersion(char *v, unsigned int len) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    return out_str(v, len, nvml_version);
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *v = cuda_driver_version;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return nvmlSystemGetCudaDriverVersion_v2(v); }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *n = (unsigned int)device_count;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (i >= (unsigned int)device_count) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpus[i].handle_error) return gpus[i].handle_error;
    *d = &gpus[i];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *v, unsigned int len) { GUARD(d); return out_str(v, len, d->name); }
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *v, unsigned int len) { GUARD(d); return out_str(v, len, d->uuid); }
nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t d, char *v, unsigned int len) { GUARD(d); return out_str(v, len, d->serial); }
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p) {
    GUARD(d);
    memset(p, 0, sizeof *p);
    unsigned int dom = 0, bus = 0, dev = 0, fn = 0;
    sscanf(d->bus_id, "%x:%x:%x.%x", &dom, &bus, &dev, &fn);
    p->domain = dom, p->bus = bus, p->device = dev;
    p->pciDeviceId = d->pci_device_id;
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
    snprintf(p->busId, sizeof p->busId, "%08X:%02X:%02X.%X", dom, bus, dev, fn);
    return NVML_SUCCESS;
}
UINT_GETTER(nvmlDeviceGetMinorNumber, minor)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, pcie_curr_gen)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, pcie_max_gen)
UINT_GETTER(nvmlDeviceGetGpuMaxPcieLinkGeneration, pcie_gpu_max_gen)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, pcie_curr_width)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, pcie_max_width)

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t d, int *current, int *pending) {
    GUARD(d);
    *current = (int)d->ecc_current, *pending = (int)d->ecc_pending;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter, unsigned long long *n) {
    GUARD(d);
    /* type 1 = NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter 0 = NVML_VOLATILE_ECC */
    *n = (type == 1 && counter == 0) ? d->ecc_volatile_uncorrected : 0;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *c, unsigned int *u, unsigned int *p,
                                       unsigned int *f) {
    GUARD(d);
    *c = d->remap_corr, *u = d->remap_unc, *p = d->remap_pending, *f = d->remap_failure;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t d, int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    GUARD(d);
    unsigned int n = cause == 0 ? d->retired_sbe : d->retired_dbe; /* 0: multiple single-bit, 1: double-bit */
    if (*count < n || (!addresses && n)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) addresses[i] = 0x100000ull * (i + 1);
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *pending) {
    GUARD(d);
    *pending = (int)d->retired_pending;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t d, int *mode) {
    GUARD(d);
    *mode = (int)d->persistence;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    GUARD(d);
    *current = d->mig_current, *pending = d->mig_pending;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t d, nvmlTemperature_t *t) {
    GUARD(d);
    if (t->version != TEMPERATURE_V1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    t->temperature = d->temperature;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *r) {
    GUARD(d);
    *r = d->clocks_event_reasons;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t d, nvmlGpuFabricInfoV_t *info) {
    GUARD(d);
    unsigned int version = info->version;
    if (!(version == FABRIC_V2 || (version == FABRIC_V3 && fabric_max_version >= 3)))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memset(info, 0, version == FABRIC_V3 ? 40 : 36);
    info->version = version;
    memcpy(info->clusterUuid, d->fabric_cluster_uuid, 16);
    info->status = (nvmlReturn_t)d->fabric_status;
    info->cliqueId = d->fabric_clique;
    info->state = (unsigned char)d->fabric_state;
    info->healthMask = d->fabric_health_mask;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceValidateInforom(nvmlDevice_t d) {
    GUARD(d);
    return d->inforom_error;
}
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int valuesCount, nvmlFieldValue_t *values) {
    GUARD(d);
    if (valuesCount < 0 || (valuesCount > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *f = &values[i];
        f->timestamp = 1767225600000000LL + i; /* microseconds */
        f->latencyUsec = 0;
        f->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        f->nvmlReturn = NVML_SUCCESS;
        memset(&f->value, 0, sizeof f->value);
        for (int e = 0; e < d->nfield_errors; e++)
            if (d->field_error_id[e] == f->fieldId) f->nvmlReturn = d->field_error_code[e];
        if (f->nvmlReturn) continue;
        if (f->fieldId == NVML_FI_DEV_NVLINK_LINK_COUNT) f->value.uiVal = d->nvlink_count;
        else if (f->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) f->value.uiVal = d->recovery_action;
        else f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, int *isActive) {
    GUARD(d);
    if (link >= NVML_NVLINK_MAX_LINKS || !isActive) return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= d->nvlink_count) return NVML_ERROR_NOT_SUPPORTED;
    *isActive = d->nvlink_down[link] ? 0 : 1; /* nvmlEnableState_t: DISABLED 0, ENABLED 1 */
    return NVML_SUCCESS;
}
/* Two calls: a first with *count 0 (or too small) learns the count through INSUFFICIENT_SIZE. */
static nvmlReturn_t out_procs(const struct proc *procs, int n, unsigned int *count, nvmlProcessInfo_t *infos) {
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < (unsigned int)n || (n && !infos)) {
        *count = (unsigned int)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        infos[i].pid = procs[i].pid;
        infos[i].usedGpuMemory = procs[i].used;
        infos[i].gpuInstanceId = 0xFFFFFFFFu; /* no MIG */
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    GUARD(d);
    return out_procs(d->compute, d->ncompute, count, infos);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    GUARD(d);
    return out_procs(d->graphics, d->ngraphics, count, infos);
}
