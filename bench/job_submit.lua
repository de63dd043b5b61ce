-- The k8scpu/k8smemory completion written for Slurm's own job_submit/lua:
-- what an admin would deploy instead of pyk8sres, and the baseline that
-- bench_job_submit.py times our plugin against.  It is the same policy as
-- pyk8sres/slurmctld/completion.py `complete` (every rule, function by
-- function, same names), so both do the same work per submission;
-- tests/unit/test_lua_baseline.py checks that they give the same answers.
--
-- What job_submit/lua cannot do, so neither does this script:
--   * see the nodes: their topology comes from SITE below, which an admin
--     writes by hand (the benchmark writes it from slurm.conf, as our
--     plugin reads it: bench/lua_site.py);
--   * see -O/--overcommit or --distribution (22.05 gives Lua neither field):
--     they are taken as not given;
--   * job_modify: not ported (the benchmark times submissions only).
-- The partitions' DefMemPerCPU/DefMemPerNode/MaxMemPerCPU are read live from
-- part_list, as our plugin reads them from slurmctld.

-- The site's facts, filled in by bench/lua_site.py (an admin writes them by hand):
local SITE = nil -- @SITE@

local NO_VAL16, NO_VAL, INFINITE16, INFINITE = 0xFFFE, 0xFFFFFFFE, 0xFFFF, 0xFFFFFFFF
local MEM_PER_CPU = 2 ^ 63
local JOB_SHARED_NONE = 0
local SPREAD_JOB = 2 ^ 8
local CR_CPU, CR_SOCKET, CR_CORE, CR_BOARD, CR_MEMORY = 0x1, 0x2, 0x4, 0x8, 0x10
local CR_ONE_TASK_PER_CORE = 0x100
local PER_TASK_BREAKS_PLANE = 0x170000
local CPU, MEM = "k8scpu", "k8smemory"
local MAX_COUNT = 2 ^ 62
local SUFFIX = { [""] = 1, k = 2 ^ 10, m = 2 ^ 20, g = 2 ^ 30, t = 2 ^ 40, p = 2 ^ 50 }

local function bit(value, flag) -- value & flag, flag a power of two (Lua 5.1 has no &)
  return math.floor(value / flag) % 2 == 1
end

local function ceil_div(a, b) return -math.floor(-a / b) end

local function given(v, ...) -- nil when v is one of Slurm's "not given" values
  if v == nil then return nil end
  for i = 1, select("#", ...) do
    if v == select(i, ...) then return nil end
  end
  return v
end

local function text(v) if v == nil or v == "" then return nil end return v end
local function positive(v) if v == nil or v <= 0 then return nil end return v end

-- gres.py ------------------------------------------------------------------

local function split(s, sep) -- keeps empty fields, as Python's str.split
  local out, start = {}, 1
  while true do
    local at = string.find(s, sep, start, true)
    if not at then table.insert(out, string.sub(s, start)) return out end
    table.insert(out, string.sub(s, start, at - 1))
    start = at + 1
  end
end

local function parse_count(s)
  local digits, suffix = string.match(s, "^(%d+)([kKmMgGtTpP]?)$")
  if not digits then return nil end
  return tonumber(digits) * SUFFIX[string.lower(suffix)]
end

local function parse(tres)
  local entries = {}
  if not tres then return entries end
  for raw in string.gmatch((string.gsub(tres, ";", ",")), "[^,]+") do
    local entry = string.match(raw, "^%s*(.-)%s*$")
    if entry ~= "" then
      local body = string.match(entry, "^gres[:/](.*)$")
      if not body then
        table.insert(entries, { text = entry })
      else
        local eq = string.find(body, "=", 1, true)
        local fields = split(eq and string.sub(body, 1, eq - 1) or body, ":")
        local name = fields[1]
        if name ~= "" then
          local count, typed
          if eq then
            count, typed = parse_count(string.sub(body, eq + 1)), #fields > 1
          else
            if #fields > 1 then count = parse_count(fields[#fields]) else count = 1 end
            typed = #fields > 2
          end
          if name == CPU or name == MEM then
            if typed or count == nil then
              error("invalid GRES '" .. body .. "': " .. name .. " takes a plain count, e.g. "
                    .. name .. ":4", 0)
            end
            if count > MAX_COUNT then
              error("invalid GRES '" .. body .. "': count too large", 0)
            end
          end
          table.insert(entries, { text = entry, name = name, count = count })
        end
      end
    end
  end
  return entries
end

local function count_of(entries, name)
  local total
  for _, e in ipairs(entries) do
    if e.name == name then total = (total or 0) + (e.count or 0) end
  end
  return total
end

local function entry_text(name, count)
  local slash = SITE.tres_slash
  if slash == nil then slash = SITE.slurm_version >= 0x170B00 end
  local sep = slash and "/" or ":"
  return "gres" .. sep .. name .. ":" .. string.format("%d", count)
end

local function with_counts(entries, counts) -- counts: {k8scpu=, k8smemory=}
  local texts = {}
  for _, e in ipairs(entries) do
    if e.name == nil or counts[e.name] == nil then table.insert(texts, e.text) end
  end
  if counts[CPU] then table.insert(texts, entry_text(CPU, counts[CPU])) end
  if counts[MEM] then table.insert(texts, entry_text(MEM, counts[MEM])) end
  return table.concat(texts, ",")
end

local function without(entries, names)
  local texts = {}
  for _, e in ipairs(entries) do
    if e.name == nil or names[e.name] == nil then table.insert(texts, e.text) end
  end
  return table.concat(texts, ",")
end

local OURS = { [CPU] = true, [MEM] = true }

-- completion.py ------------------------------------------------------------

local function gpus(tres)
  if not tres then return nil end
  return count_of(parse(tres), "gpu")
end

local function fixed_tasks(job)
  if not job.num_tasks then return job.ntasks_per_node or 1 end
  if job.num_tasks == 1 then return 1 end
  local nodes = job.min_nodes or 1
  if job.max_nodes ~= nodes then return nil end
  if nodes == 1 then return job.num_tasks end
  if job.num_tasks == nodes then return 1 end
  if job.ntasks_per_node and job.num_tasks == nodes * job.ntasks_per_node then
    return job.ntasks_per_node
  end
  return nil
end

local function max_tasks(job)
  if not job.num_tasks then return job.ntasks_per_node or 1 end
  local most = job.num_tasks - (job.min_nodes or 1) + 1
  if job.ntasks_per_node then most = math.min(most, job.ntasks_per_node) end
  return math.max(most, 1)
end

local function one_node(job)
  return job.max_nodes == 1 or ((job.min_nodes or 1) == 1 and (job.num_tasks or 1) == 1)
end

local function gpus_per_node(job, tasks, most)
  local n = gpus(job.tres_per_node)
  if not n or n == 0 then
    local per_task = gpus(job.tres_per_task)
    if per_task and per_task ~= 0 and tasks then
      n = per_task * tasks
    else
      n = gpus(job.tres_per_job)
      if n and n ~= 0 and most and not one_node(job) then n = most end
    end
  end
  if not n or n == 0 then
    local per_socket = gpus(job.tres_per_socket)
    if per_socket and per_socket ~= 0 then n = most or per_socket else n = nil end
  end
  if n and most then return math.min(n, most) end
  return n
end

local function asks_gpus(job)
  for _, tres in ipairs({ job.tres_per_node or false, job.tres_per_task or false,
                          job.tres_per_job or false, job.tres_per_socket or false }) do
    if tres then
      local n = gpus(tres)
      if n and n ~= 0 then return true end
    end
  end
  return false
end

local function whole_sockets(cores, socket_cores, most_cores)
  if #socket_cores == 1 and socket_cores[1] == 1 then return cores end
  local best = cores
  for _, size in ipairs(socket_cores) do
    local sockets = cores
    if most_cores and most_cores ~= 0 then
      sockets = math.min(cores, math.floor(most_cores / size))
    end
    best = math.max(best, sockets * size)
  end
  return best
end

local function gpu_default(part)
  local own, cluster = part.gpu or {}, SITE.cluster_gpu or {}
  local cpus, mem = own.cpus, own.mem
  if cpus == nil then cpus = cluster.cpus end
  if mem == nil then mem = cluster.mem end
  return cpus, mem
end

local function whole_node_memory(nodes)
  local most = nodes.memory or 1
  if nodes.least_memory ~= nil and nodes.least_memory ~= most then
    error(string.format("this job gets all of a node's memory (--mem=0, or no memory asked "
      .. "and no DefMemPerCPU/DefMemPerNode set), and its nodes have %d to %d MB: no single "
      .. "k8smemory count covers that; ask for --mem=<MB> or --mem-per-cpu=<MB>, or add "
      .. "--exclusive (or set DefMemPerCPU in slurm.conf)", nodes.least_memory, most), 0)
  end
  local left = math.max(0, most - (SITE.reserve_memory or 0))
  if left == 0 then return nil end
  return left
end

local function plan(job, part, always_per_node)
  local nodes = part.nodes
  local c = job.cpus_per_task or 1
  local min_cpus_node = job.pn_min_cpus or 0
  local mem_node, mem_cpu = job.mem_per_node, job.mem_per_cpu
  local mem_per_gpu = gpus(job.mem_per_tres)
  local cpus_per_gpu = gpus(job.cpus_per_tres)
  if mem_per_gpu == 0 then mem_per_gpu = nil end
  if cpus_per_gpu == 0 then cpus_per_gpu = nil end
  local default_cpus_per_gpu
  if (job.tres_per_node or job.tres_per_task or job.tres_per_job or job.tres_per_socket)
      and asks_gpus(job) then
    local gpu_cpus, gpu_mem = gpu_default(part)
    if gpu_cpus == 0 then gpu_cpus = nil end
    if gpu_mem == 0 then gpu_mem = nil end
    if job.cpus_per_task == nil and gpu_cpus then
      default_cpus_per_gpu = gpu_cpus
      cpus_per_gpu = cpus_per_gpu or gpu_cpus
    end
    if mem_node == nil and mem_cpu == nil then mem_per_gpu = mem_per_gpu or gpu_mem end
  end
  if mem_node == nil and mem_cpu == nil and not mem_per_gpu then
    local default = part.mem
    if not ((default.per_cpu or 0) ~= 0 or (default.per_node or 0) ~= 0) then
      default = SITE.cluster_mem
    end
    mem_node, mem_cpu = default.per_node, default.per_cpu
  end
  local max_mpc = part.max_mem_per_cpu or SITE.max_mem_per_cpu
  if max_mpc == 0 then max_mpc = nil end
  if max_mpc and mem_cpu and mem_cpu ~= 0 and mem_cpu > max_mpc then
    local ratio = ceil_div(mem_cpu, max_mpc)
    c = c * ratio
    mem_cpu = ceil_div(mem_cpu, ratio)
  elseif max_mpc and mem_node and mem_node ~= 0 then
    min_cpus_node = math.max(min_cpus_node, ceil_div(mem_node, max_mpc))
    if job.ntasks_per_node then
      c = math.max(c, ceil_div(min_cpus_node, job.ntasks_per_node))
    end
  end
  if default_cpus_per_gpu and job.tres_per_task then
    c = math.max(c, (gpus(job.tres_per_task) or 0) * default_cpus_per_gpu)
  end

  local param = SITE.select_type_param
  if mem_node == 0 and bit(param, CR_MEMORY) and not job.exclusive then
    mem_node = whole_node_memory(nodes)
  end
  local per_socket_gpus = gpus(job.tres_per_socket)
  if mem_per_gpu and not (mem_node and mem_node ~= 0) and per_socket_gpus
      and per_socket_gpus ~= 0 then
    mem_node = whole_node_memory(nodes)
  end
  if mem_node == 0 then mem_node = nil end   -- 0 left: not consumable, or --exclusive
  if mem_cpu == 0 then mem_cpu = nil end

  if job.ntasks_per_node and ((not job.overcommit and
      (job.num_tasks or job.ntasks_per_node * (job.min_nodes or 1)) > 1) or
      SITE.ntasks_per_node_fills) then
    min_cpus_node = math.max(min_cpus_node, c * job.ntasks_per_node)
  end

  local tpc = nodes.threads_per_core or 1
  local socket_cores = { 1 }
  if bit(param, CR_SOCKET) then socket_cores = nodes.cores_per_socket or { 1 } end
  local by_sockets = not (#socket_cores == 1 and socket_cores[1] == 1)
  local whole_cores = (bit(param, CR_CPU) or bit(param, CR_CORE) or bit(param, CR_SOCKET)
                       or bit(param, CR_BOARD)) and (tpc > 1 or by_sockets)
  local most_cores
  if nodes.cpus then most_cores = math.floor(nodes.cpus / tpc) end
  local ntasks_per_core = job.ntasks_per_core
  if not ntasks_per_core and bit(param, CR_ONE_TASK_PER_CORE) then ntasks_per_core = 1 end
  local vpus = tpc
  if ntasks_per_core then vpus = math.min(vpus, ntasks_per_core * c) end
  if job.threads_per_core then vpus = math.min(vpus, job.threads_per_core) end
  local mem_threads = math.min(tpc, job.threads_per_core or tpc)

  local function cpus(t)
    local n = math.max(t * c, min_cpus_node)
    if cpus_per_gpu then
      local g = gpus_per_node(job, t, nodes.gpus)
      if g and g ~= 0 then n = math.max(n, cpus_per_gpu * g) end
    end
    if not whole_cores then return n end
    local cores = ceil_div(n, vpus)
    if ntasks_per_core == 1 and c > vpus then
      cores = math.max(cores, math.floor(n / c) * ceil_div(c, vpus))
    end
    return whole_sockets(cores, socket_cores, most_cores) * tpc
  end

  local function cpus_rounded(n)
    if not whole_cores then return n end
    return whole_sockets(ceil_div(n, tpc), socket_cores, most_cores) * tpc
  end

  local function memory(t, node_cpus)
    if mem_node then return mem_node end
    if mem_per_gpu then
      local g = gpus_per_node(job, t, nodes.gpus)
      if g and g ~= 0 then return mem_per_gpu * g end
      return nil
    end
    if mem_cpu then
      local counted = node_cpus
      if whole_cores then counted = math.floor(node_cpus / tpc) * mem_threads end
      return mem_cpu * counted
    end
    return nil
  end

  local function figures(node_cpus, node_mem)
    local out = { [CPU] = node_cpus }
    if node_mem and node_mem ~= 0 then out[MEM] = node_mem end
    return out
  end

  if job.exclusive then
    local n = cpus(1)
    return { per_node = figures(n, memory(1, n)), mem_per_node = mem_node }
  end
  local fixed
  if job.overcommit then fixed = 1 else fixed = fixed_tasks(job) end
  if fixed then
    local n = cpus(fixed)
    if job.min_cpus and not job.overcommit then
      n = math.max(n, job.min_cpus - ((job.min_nodes or 1) - 1) * n)
      if nodes.cpus then n = math.min(n, math.max(nodes.cpus, cpus(fixed))) end
      n = cpus_rounded(n)
    end
    return { per_node = figures(n, memory(fixed, n)), mem_per_node = mem_node }
  end
  local one = cpus(1)
  local per_task
  local cpus_above_tasks = job.min_cpus ~= nil and job.min_cpus > job.num_tasks * c
  local linear = min_cpus_node <= c and not cpus_per_gpu and not mem_per_gpu
                 and not job.threads_per_core and not cpus_above_tasks
  local rounding_only = linear
  if linear and whole_cores then
    linear = c % vpus == 0 or (ntasks_per_core == 1 and c > vpus)
  end
  if not linear and rounding_only and nodes.count and nodes.least_cpus
      and SITE.gres_fits_cores then
    local usable = math.min(job.max_nodes or nodes.count, nodes.count)
    linear = usable * math.floor(nodes.least_cpus / one) >= job.num_tasks
  end
  if (job.spread_job and SITE.spread_per_task_crashes) or
      (job.plane_distribution and SITE.slurm_version >= PER_TASK_BREAKS_PLANE) then
    linear = false
  end
  if by_sockets then linear = false end
  if linear then
    per_task = { [CPU] = one }
    local one_mem = memory(1, one)
    if one_mem and one_mem ~= 0 and not mem_node then per_task[MEM] = one_mem end
  end
  if per_task and not always_per_node then
    return { per_task = per_task, per_node = {}, mem_per_node = mem_node }
  end
  local most = max_tasks(job)
  local extra = 0
  if cpus_above_tasks then extra = job.min_cpus - ((job.min_nodes or 1) - 1) * one end
  local n = math.max(cpus(most), cpus_rounded(extra))
  if nodes.cpus then n = math.min(n, math.max(nodes.cpus, one)) end
  local mem = memory(most, n)
  if mem and mem ~= 0 and nodes.memory and not mem_node then
    mem = math.min(mem, math.max(nodes.memory, memory(1, one) or 0))
  end
  return { per_task = per_task, per_node = figures(n, mem), mem_per_node = mem_node,
           most = true }
end

local function partition(name)
  return SITE.partitions[name] or { mem = {}, nodes = SITE.all_nodes, gpu = {} }
end

local function partitions(job)
  if not job.partition then
    return { partition(SITE.default_partition or "") }
  end
  local out = {}
  for _, name in ipairs(split(job.partition, ",")) do
    name = string.match(name, "^%s*(.-)%s*$")
    if name ~= "" then table.insert(out, partition(name)) end
  end
  if #out == 0 then out = { partition("") } end
  return out
end

local function merge(list)
  local out = {}
  for _, d in ipairs(list) do
    for name, value in pairs(d) do out[name] = math.max(out[name] or 0, value) end
  end
  return out
end

local function fits(per_node, nodes)
  return (not nodes.cpus or (per_node[CPU] or 0) <= nodes.cpus) and
         (not nodes.memory or (per_node[MEM] or 0) <= nodes.memory)
end

local function room(per_node, nodes)
  if not nodes.cpu_counts or #nodes.cpu_counts == 0 then return nil end
  local need, sum = per_node[CPU] or 0, 0
  for _, pair in ipairs(nodes.cpu_counts) do
    if pair[1] >= need then sum = sum + pair[2] end
  end
  return sum
end

local function required(job)
  local parts = partitions(job)
  local plans = {}
  for i, part in ipairs(parts) do plans[i] = plan(job, part, #parts > 1) end
  if #parts > 1 then
    local fit_plans, fit_parts = {}, {}
    for i, p in ipairs(plans) do
      if fits(p.per_node, parts[i].nodes) then
        table.insert(fit_plans, p)
        table.insert(fit_parts, parts[i])
      end
    end
    if #fit_plans > 0 then plans, parts = fit_plans, fit_parts end
  end
  local all_per_task, some_mem, some_without = true, false, false
  for _, p in ipairs(plans) do
    if not p.per_task then all_per_task = false end
    if p.mem_per_node then some_mem = true else some_without = true end
  end
  local per_node, per_task
  if all_per_task and not (some_mem and some_without) then
    local list = {}
    for i, p in ipairs(plans) do list[i] = p.per_task end
    per_task = merge(list)
    per_node = {}
    if some_mem and not per_task[MEM] then
      local most = 0
      for _, p in ipairs(plans) do most = math.max(most, p.mem_per_node or 0) end
      per_node[MEM] = most
    end
  else
    local list, all_most = {}, true
    for i, p in ipairs(plans) do
      list[i] = p.per_node
      if not p.most then all_most = false end
    end
    per_task, per_node = {}, merge(list)
    local nodes = job.min_nodes or 1
    local short, most_room = all_most, 0
    if all_most then
      for i, p in ipairs(plans) do
        local r = room(p.per_node, parts[i].nodes)
        if r == nil or r >= nodes then short = false break end
        most_room = math.max(most_room, r)
      end
    end
    if short then
      error(string.format("this job may get up to %d CPUs on one of its nodes (Slurm decides "
        .. "when it schedules it), so it must hold k8scpu:%d on each; it needs %d nodes and "
        .. "only %d of its partition's nodes have that many CPUs: ask --ntasks-per-node=<k> "
        .. "(each node then gets k x -c CPUs), fewer nodes (-N), or a partition whose nodes "
        .. "are all of one size", per_node[CPU], per_node[CPU], nodes, most_room), 0)
    end
  end
  local limits = { [CPU] = NO_VAL, [MEM] = MAX_COUNT }
  for _, counts in ipairs({ per_node, per_task }) do
    for name, value in pairs(counts) do
      if value > limits[name] then
        error(string.format("%s:%d is larger than any node can have", name, value), 0)
      end
    end
  end
  return per_node, per_task
end

local function apply(current, want, field)
  if not current and next(want) == nil then return nil end
  local entries = parse(current)
  local final = {}
  for _, name in ipairs({ CPU, MEM }) do
    local asked, need = count_of(entries, name), want[name]
    if need == nil then
      if asked ~= nil then final[name] = asked end
    else
      if asked ~= nil and asked < need and SITE.under_request == "reject" then
        error(string.format("--gres=%s:%d is less than the job uses (%s:%d %s)", name, asked,
              name, need, field), 0)
      end
      final[name] = math.max(need, asked or 0)
    end
  end
  local new = with_counts(entries, final)
  if new == (current or "") then return nil end
  return new
end

local function complete(job)
  if job.ntasks_per_tres then
    error("--ntasks-per-gpu cannot run with the k8scpu/k8smemory every job here holds: Slurm "
      .. "applies it to each of a job's GRES (every MB of k8smemory would need "
      .. "--ntasks-per-gpu CPUs); ask -n <tasks> with --gpus or --gpus-per-node instead", 0)
  end
  if job.spread_job and SITE.spread_per_task_crashes then
    for _, tres in ipairs({ job.tres_per_job or false, job.tres_per_task or false }) do
      for _, e in ipairs(parse(tres or nil)) do
        if e.name then
          error("--spread-job with a per-job or per-task GRES (--gpus, --gpus-per-task, "
            .. "--tres-per-task) crashes slurmctld on this Slurm release; ask it per node "
            .. "(--gpus-per-node) or leave out --spread-job", 0)
        end
      end
    end
  end
  for _, tres in ipairs({ job.tres_per_job or false, job.tres_per_socket or false }) do
    if tres then
      for _, e in ipairs(parse(tres)) do
        if e.name and OURS[e.name] then
          error("k8scpu/k8smemory can only be requested per node (--gres=k8scpu:N), not per "
            .. "job or per socket", 0)
        end
      end
    end
  end
  local per_node, per_task = required(job)
  local has_per_task = next(per_task) ~= nil
  if has_per_task then
    local node_entries = parse(job.tres_per_node)
    for name, count in pairs(per_task) do
      local asked = count_of(node_entries, name)
      if asked ~= nil and SITE.under_request == "reject" and
          asked < count * (job.num_tasks or 1) then
        error(string.format("--gres=%s:%d is less than the job uses (%s:%d per task)",
              name, asked, name, count), 0)
      end
    end
  elseif job.tres_per_task then
    local task_entries = parse(job.tres_per_task)
    for name, count in pairs(per_node) do
      local asked = count_of(task_entries, name)
      if asked ~= nil then per_node[name] = math.max(count, asked) end
    end
  end
  local new_node = apply(job.tres_per_node, per_node, "per node")
  local new_task
  if has_per_task then
    local base = new_node or job.tres_per_node or ""
    local stripped = without(parse(base), per_task)
    if stripped ~= (job.tres_per_node or "") then new_node = stripped end
    new_task = apply(job.tres_per_task, per_task, "per task")
  elseif job.tres_per_task then
    local stripped = without(parse(job.tres_per_task), per_node)
    if stripped ~= job.tres_per_task then new_task = stripped end
  end
  return new_node, new_task
end

-- The job as completion.py's Job: Slurm's "not given" values become nil.
local function decode(d)
  local mem_node, mem_cpu = d.min_mem_per_node, d.min_mem_per_cpu
  if mem_cpu and mem_cpu >= MEM_PER_CPU then mem_cpu = nil end  -- INFINITE64: not given
  if mem_cpu == 0 then mem_node, mem_cpu = 0, nil end  -- Slurm maps --mem-per-cpu=0 to --mem=0
  local bitflags = d.bitflags or 0
  return {
    cpus_per_task = given(d.cpus_per_task, NO_VAL16, 0),
    num_tasks = given(d.num_tasks, NO_VAL, 0),
    ntasks_per_node = given(d.ntasks_per_node, NO_VAL16, INFINITE16, 0),
    min_cpus = given(d.min_cpus, NO_VAL, 0),
    min_nodes = given(d.min_nodes, NO_VAL, 0),
    max_nodes = given(d.max_nodes, NO_VAL, INFINITE, 0),
    pn_min_cpus = given(d.pn_min_cpus, NO_VAL16, NO_VAL, 0),
    mem_per_node = mem_node,
    mem_per_cpu = mem_cpu,
    exclusive = d.shared == JOB_SHARED_NONE,
    partition = text(d.partition),
    tres_per_node = text(d.tres_per_node),
    tres_per_task = text(d.tres_per_task),
    tres_per_job = text(d.tres_per_job),
    tres_per_socket = text(d.tres_per_socket),
    cpus_per_tres = text(d.cpus_per_tres),
    mem_per_tres = text(d.mem_per_tres),
    ntasks_per_core = given(d.ntasks_per_core, NO_VAL16, INFINITE16, 0),
    threads_per_core = given(d.threads_per_core, NO_VAL16, 0),
    overcommit = false,          -- not visible to job_submit/lua
    spread_job = bit(bitflags, SPREAD_JOB),
    plane_distribution = false,  -- not visible to job_submit/lua
    ntasks_per_tres = given(d.ntasks_per_tres, NO_VAL16, INFINITE16, 0),
  }
end

-- The job's partitions with their live memory settings from part_list
-- (`scontrol update PartitionName=` changes them without a reconfigure).
local function live_partitions(job, part_list)
  local names = job.partition or SITE.default_partition
  if not names or not part_list then return end
  for _, name in ipairs(split(names, ",")) do
    local live = part_list[name]
    if live then
      local known = SITE.partitions[name] or { nodes = SITE.all_nodes, gpu = {} }
      SITE.partitions[name] = {
        mem = { per_cpu = positive(live.def_mem_per_cpu),
                per_node = positive(live.def_mem_per_node) },
        max_mem_per_cpu = positive(live.max_mem_per_cpu),
        nodes = known.nodes, gpu = known.gpu or {} }
    end
  end
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local ok, node, task = pcall(function()
    local job = decode(job_desc)
    live_partitions(job, part_list)
    return complete(job)
  end)
  if not ok then
    slurm.log_user("%s", tostring(node))
    return slurm.ERROR
  end
  if node ~= nil then job_desc.tres_per_node = node end
  if task ~= nil then job_desc.tres_per_task = task end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
