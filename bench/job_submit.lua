-- The k8scpu/k8smemory completion written for Slurm's own job_submit/lua:
-- what an admin would deploy instead of pyk8sres.  bench_job_submit.py
-- times it against our plugin.  Same per-node / per-task rules (CPUs,
-- --mem, --mem-per-cpu, partition or cluster default memory).
local DEF_MEM_PER_CPU = 100 -- the benchmark cluster's DefMemPerCPU

local function strip_ours(tres)
  if tres == nil then return "" end
  local kept = {}
  for entry in string.gmatch(tres, "[^,]+") do
    if not string.match(entry, "^gres[:/]k8s") then table.insert(kept, entry) end
  end
  return table.concat(kept, ",")
end

local function append(tres, cpu, mem)
  local out = strip_ours(tres)
  local add = {}
  if cpu then table.insert(add, "gres:k8scpu:" .. cpu) end
  if mem then table.insert(add, "gres:k8smemory:" .. mem) end
  local extra = table.concat(add, ",")
  if out == "" then return extra end
  if extra == "" then return out end
  return out .. "," .. extra
end

local function set(v, none)
  if v == nil or v == none or v == 0 then return nil end
  return v
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local cpt = set(job_desc.cpus_per_task, slurm.NO_VAL16) or 1
  local ntasks = set(job_desc.num_tasks, slurm.NO_VAL)
  local per_node = set(job_desc.ntasks_per_node, slurm.NO_VAL16)
  local nodes = set(job_desc.min_nodes, slurm.NO_VAL)
  local tasks
  if per_node then tasks = per_node
  elseif not ntasks or ntasks == 1 then tasks = 1
  elseif nodes then tasks = math.ceil(ntasks / nodes)
  end
  local mem_node = job_desc.min_mem_per_node
  local mem_cpu = job_desc.min_mem_per_cpu
  if mem_node == nil and mem_cpu == nil then
    local part = job_desc.partition and part_list[job_desc.partition]
    mem_cpu = (part and part.def_mem_per_cpu) or DEF_MEM_PER_CPU
  end
  if tasks then
    local cpus = tasks * cpt
    local pn = set(job_desc.pn_min_cpus, slurm.NO_VAL16)
    if pn and pn > cpus then cpus = pn end
    local mem = mem_node or (mem_cpu and mem_cpu * cpus)
    job_desc.tres_per_node = append(job_desc.tres_per_node, cpus, mem)
  else
    job_desc.tres_per_task = append(job_desc.tres_per_task, cpt, mem_cpu and mem_cpu * cpt)
    if mem_node then
      job_desc.tres_per_node = append(job_desc.tres_per_node, nil, mem_node)
    end
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
