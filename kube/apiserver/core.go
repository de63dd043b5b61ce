package main

// The legacy core group and rbac, built from the external (v1) Go types of
// k8s.io/api. Upstream kube-apiserver keeps separate "internal" types in
// k8s.io/kubernetes, which Debian does not package; here the v1 types are
// also registered as the internal version, so conversion is the identity.

import (
	"context"
	"fmt"
	"net/url"
	"reflect"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/validation/field"
	genericapirequest "k8s.io/apiserver/pkg/endpoints/request"
	"k8s.io/apiserver/pkg/registry/generic"
	genericregistry "k8s.io/apiserver/pkg/registry/generic/registry"
	"k8s.io/apiserver/pkg/registry/rest"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/names"
	"sigs.k8s.io/structured-merge-diff/v6/fieldpath"
)

var (
	coreScheme = runtime.NewScheme()
	coreCodecs = serializer.NewCodecFactory(coreScheme)

	coreGroupVersions = []schema.GroupVersion{corev1.SchemeGroupVersion, rbacv1.SchemeGroupVersion,
		admissionregistrationv1.SchemeGroupVersion}

	// Go packages whose types are served (the rest are meta types).
	typePackages = map[string]bool{
		reflect.TypeOf(corev1.Pod{}).PkgPath():                                             true,
		reflect.TypeOf(rbacv1.Role{}).PkgPath():                                            true,
		reflect.TypeOf(admissionregistrationv1.ValidatingWebhookConfiguration{}).PkgPath(): true,
	}
)

func init() {
	must(corev1.AddToScheme(coreScheme))
	must(rbacv1.AddToScheme(coreScheme))
	must(admissionregistrationv1.AddToScheme(coreScheme))
	// Register every external type once more as the internal version of its
	// group: the generic registry converts to "internal" before storing.
	for _, gv := range coreGroupVersions {
		internal := schema.GroupVersion{Group: gv.Group, Version: runtime.APIVersionInternal}
		for kind, t := range coreScheme.KnownTypes(gv) {
			if !typePackages[t.PkgPath()] {
				continue // meta types (ListOptions, WatchEvent...) are handled by metav1
			}
			coreScheme.AddKnownTypeWithName(internal.WithKind(kind), reflect.New(t).Interface().(runtime.Object))
		}
	}
	// Same unversioned meta types as the apiextensions scheme registers.
	unversioned := schema.GroupVersion{Group: "", Version: "v1"}
	coreScheme.AddUnversionedTypes(unversioned,
		&metav1.Status{}, &metav1.APIVersions{}, &metav1.APIGroupList{}, &metav1.APIGroup{}, &metav1.APIResourceList{})

	// Field selectors accepted per kind (the apiserver rejects others with 400,
	// like upstream).
	for kind, fn := range map[string]func(runtime.Object) fields.Set{
		"Pod": podFields, "Node": nodeFields, "Namespace": namespaceFields, "Event": eventFields,
		"ConfigMap": nil, "Secret": secretFields, "ServiceAccount": nil,
	} {
		gvk := corev1.SchemeGroupVersion.WithKind(kind)
		allowed := fieldKeys(kind, fn)
		must(coreScheme.AddFieldLabelConversionFunc(gvk, func(label, value string) (string, string, error) {
			if allowed[label] {
				return label, value, nil
			}
			return "", "", fmt.Errorf("field label not supported: %s", label)
		}))
	}
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}

// fieldKeys lists the selectable fields of a kind by calling its field
// function on an empty object.
func fieldKeys(kind string, fn func(runtime.Object) fields.Set) map[string]bool {
	obj, err := coreScheme.New(corev1.SchemeGroupVersion.WithKind(kind))
	must(err)
	keys := map[string]bool{"metadata.name": true, "metadata.namespace": true}
	if fn != nil {
		for k := range fn(obj) {
			keys[k] = true
		}
	}
	return keys
}

// ---- field sets used by field selectors (and the watch cache) ----

func objectMetaFields(obj runtime.Object) fields.Set {
	m, _ := meta.Accessor(obj)
	s := fields.Set{"metadata.name": m.GetName()}
	if m.GetNamespace() != "" {
		s["metadata.namespace"] = m.GetNamespace()
	}
	return s
}

func podFields(obj runtime.Object) fields.Set {
	p := obj.(*corev1.Pod)
	return generic.MergeFieldsSets(objectMetaFields(obj), fields.Set{
		"spec.nodeName":            p.Spec.NodeName,
		"spec.restartPolicy":       string(p.Spec.RestartPolicy),
		"spec.schedulerName":       p.Spec.SchedulerName,
		"spec.serviceAccountName":  p.Spec.ServiceAccountName,
		"spec.hostNetwork":         fmt.Sprint(p.Spec.HostNetwork),
		"status.phase":             string(p.Status.Phase),
		"status.podIP":             p.Status.PodIP,
		"status.nominatedNodeName": p.Status.NominatedNodeName,
	})
}

func nodeFields(obj runtime.Object) fields.Set {
	n := obj.(*corev1.Node)
	return generic.MergeFieldsSets(objectMetaFields(obj), fields.Set{
		"spec.unschedulable": fmt.Sprint(n.Spec.Unschedulable),
	})
}

func namespaceFields(obj runtime.Object) fields.Set {
	n := obj.(*corev1.Namespace)
	return generic.MergeFieldsSets(objectMetaFields(obj), fields.Set{"status.phase": string(n.Status.Phase)})
}

func secretFields(obj runtime.Object) fields.Set {
	return generic.MergeFieldsSets(objectMetaFields(obj), fields.Set{"type": string(obj.(*corev1.Secret).Type)})
}

func eventFields(obj runtime.Object) fields.Set {
	e := obj.(*corev1.Event)
	return generic.MergeFieldsSets(objectMetaFields(obj), fields.Set{
		"involvedObject.kind":            e.InvolvedObject.Kind,
		"involvedObject.namespace":       e.InvolvedObject.Namespace,
		"involvedObject.name":            e.InvolvedObject.Name,
		"involvedObject.uid":             string(e.InvolvedObject.UID),
		"involvedObject.apiVersion":      e.InvolvedObject.APIVersion,
		"involvedObject.resourceVersion": e.InvolvedObject.ResourceVersion,
		"involvedObject.fieldPath":       e.InvolvedObject.FieldPath,
		"reason":                         e.Reason,
		"reportingComponent":             e.ReportingController,
		"source":                         e.Source.Component,
		"type":                           e.Type,
	})
}

// ---- resource descriptions ----

type resourceDef struct {
	gv         schema.GroupVersion
	resource   string
	singular   string
	kind       string
	namespaced bool
	shortNames []string
	categories []string
	hasStatus  bool                            // spec/status split with a /status subresource
	fieldsFn   func(runtime.Object) fields.Set // nil: metadata only
	onCreate   func(obj runtime.Object)        // upstream-like defaults set by the server
	defaults   func(obj runtime.Object)        // defaults applied on create and update
	validate   func(obj, old runtime.Object) field.ErrorList
	ttl        uint64 // seconds, 0 = forever (events expire like upstream's 1h)
}

var coreResources = []resourceDef{
	{gv: corev1.SchemeGroupVersion, resource: "pods", singular: "pod", kind: "Pod", namespaced: true,
		shortNames: []string{"po"}, categories: []string{"all"}, hasStatus: true, fieldsFn: podFields,
		onCreate: podOnCreate, validate: validatePod},
	{gv: corev1.SchemeGroupVersion, resource: "nodes", singular: "node", kind: "Node",
		shortNames: []string{"no"}, hasStatus: true, fieldsFn: nodeFields},
	{gv: corev1.SchemeGroupVersion, resource: "namespaces", singular: "namespace", kind: "Namespace",
		shortNames: []string{"ns"}, hasStatus: true, fieldsFn: namespaceFields, onCreate: namespaceOnCreate,
		defaults: namespaceDefaults},
	{gv: corev1.SchemeGroupVersion, resource: "events", singular: "event", kind: "Event", namespaced: true,
		shortNames: []string{"ev"}, fieldsFn: eventFields, ttl: 3600},
	{gv: corev1.SchemeGroupVersion, resource: "configmaps", singular: "configmap", kind: "ConfigMap", namespaced: true,
		shortNames: []string{"cm"}},
	{gv: corev1.SchemeGroupVersion, resource: "secrets", singular: "secret", kind: "Secret", namespaced: true,
		fieldsFn: secretFields},
	{gv: corev1.SchemeGroupVersion, resource: "serviceaccounts", singular: "serviceaccount", kind: "ServiceAccount",
		namespaced: true, shortNames: []string{"sa"}},
	{gv: rbacv1.SchemeGroupVersion, resource: "clusterroles", singular: "clusterrole", kind: "ClusterRole"},
	{gv: rbacv1.SchemeGroupVersion, resource: "clusterrolebindings", singular: "clusterrolebinding", kind: "ClusterRoleBinding"},
	{gv: rbacv1.SchemeGroupVersion, resource: "roles", singular: "role", kind: "Role", namespaced: true},
	{gv: rbacv1.SchemeGroupVersion, resource: "rolebindings", singular: "rolebinding", kind: "RoleBinding", namespaced: true},
	{gv: admissionregistrationv1.SchemeGroupVersion, resource: "validatingwebhookconfigurations",
		singular: "validatingwebhookconfiguration", kind: "ValidatingWebhookConfiguration",
		categories: []string{"api-extensions"}, defaults: webhookConfigDefaults, validate: validateWebhookConfig},
	{gv: admissionregistrationv1.SchemeGroupVersion, resource: "mutatingwebhookconfigurations",
		singular: "mutatingwebhookconfiguration", kind: "MutatingWebhookConfiguration",
		categories: []string{"api-extensions"}, defaults: webhookConfigDefaults, validate: validateWebhookConfig},
}

func podOnCreate(obj runtime.Object) {
	p := obj.(*corev1.Pod)
	// Like upstream: a new pod starts Pending whatever status was sent; the
	// status subresource (kubelet's job) moves it on.
	p.Status = corev1.PodStatus{Phase: corev1.PodPending}
	if p.Spec.RestartPolicy == "" {
		p.Spec.RestartPolicy = corev1.RestartPolicyAlways
	}
	if p.Spec.SchedulerName == "" {
		p.Spec.SchedulerName = corev1.DefaultSchedulerName
	}
	if p.Spec.DNSPolicy == "" {
		p.Spec.DNSPolicy = corev1.DNSClusterFirst
	}
	if p.Spec.TerminationGracePeriodSeconds == nil {
		g := int64(corev1.DefaultTerminationGracePeriodSeconds)
		p.Spec.TerminationGracePeriodSeconds = &g
	}
}

func namespaceOnCreate(obj runtime.Object) {
	obj.(*corev1.Namespace).Status = corev1.NamespaceStatus{Phase: corev1.NamespaceActive}
}

// namespaceDefaults sets the immutable kubernetes.io/metadata.name label, as
// kube-apiserver does: webhooks' namespaceSelectors match on it.
func namespaceDefaults(obj runtime.Object) {
	ns := obj.(*corev1.Namespace)
	if ns.Labels == nil {
		ns.Labels = map[string]string{}
	}
	ns.Labels[corev1.LabelMetadataName] = ns.Name
}

// validatePod checks the few pod rules clients are most likely to trip on.
func validatePod(obj, old runtime.Object) field.ErrorList {
	p := obj.(*corev1.Pod)
	var errs field.ErrorList
	spec := field.NewPath("spec")
	if len(p.Spec.Containers) == 0 {
		errs = append(errs, field.Required(spec.Child("containers"), ""))
	}
	for i, c := range p.Spec.Containers {
		if c.Name == "" {
			errs = append(errs, field.Required(spec.Child("containers").Index(i).Child("name"), ""))
		}
		if c.Image == "" {
			errs = append(errs, field.Required(spec.Child("containers").Index(i).Child("image"), ""))
		}
	}
	if old != nil {
		o := old.(*corev1.Pod)
		// nodeName is set once, at creation or through pods/binding.
		if o.Spec.NodeName != p.Spec.NodeName {
			errs = append(errs, field.Forbidden(spec.Child("nodeName"), "pod updates may not change spec.nodeName"))
		}
	}
	return errs
}

// ---- a generic strategy ----

type strategy struct {
	runtime.ObjectTyper
	names.NameGenerator
	def    *resourceDef
	status bool // the /status subresource strategy
	resize bool // the pods/resize subresource strategy
}

func (s strategy) NamespaceScoped() bool                                             { return s.def.namespaced }
func (s strategy) AllowCreateOnUpdate() bool                                         { return false }
func (s strategy) AllowUnconditionalUpdate() bool                                    { return true }
func (s strategy) Canonicalize(obj runtime.Object)                                   {}
func (s strategy) WarningsOnCreate(ctx context.Context, obj runtime.Object) []string { return nil }
func (s strategy) WarningsOnUpdate(ctx context.Context, obj, old runtime.Object) []string {
	return nil
}

func (s strategy) PrepareForCreate(ctx context.Context, obj runtime.Object) {
	m, _ := meta.Accessor(obj)
	m.SetGeneration(1)
	if s.def.onCreate != nil {
		s.def.onCreate(obj)
	}
	if s.def.defaults != nil {
		s.def.defaults(obj)
	}
}

// field returns the named struct field (Spec/Status) of a typed object.
func structField(obj runtime.Object, name string) reflect.Value {
	return reflect.ValueOf(obj).Elem().FieldByName(name)
}

func (s strategy) PrepareForUpdate(ctx context.Context, obj, old runtime.Object) {
	if s.def.defaults != nil {
		s.def.defaults(obj)
	}
	if !s.def.hasStatus {
		return
	}
	if s.resize {
		// pods/resize may only change containers' resources.
		resizePod(obj, old)
	} else if s.status {
		// /status may only change status (and metadata), like upstream.
		structField(obj, "Spec").Set(structField(old, "Spec"))
		return
	} else {
		// The main resource ignores status changes.
		structField(obj, "Status").Set(structField(old, "Status"))
	}
	// Bump generation on spec change.
	if !equality.Semantic.DeepEqual(structField(obj, "Spec").Interface(), structField(old, "Spec").Interface()) {
		m, _ := meta.Accessor(obj)
		om, _ := meta.Accessor(old)
		m.SetGeneration(om.GetGeneration() + 1)
	}
}

func (s strategy) nameFn() apivalidation.ValidateNameFunc {
	if s.def.resource == "namespaces" {
		return apivalidation.ValidateNamespaceName
	}
	return apivalidation.NameIsDNSSubdomain
}

func (s strategy) Validate(ctx context.Context, obj runtime.Object) field.ErrorList {
	m, _ := meta.Accessor(obj)
	errs := apivalidation.ValidateObjectMetaAccessor(m, s.def.namespaced, s.nameFn(), field.NewPath("metadata"))
	if s.def.validate != nil {
		errs = append(errs, s.def.validate(obj, nil)...)
	}
	return errs
}

func (s strategy) ValidateUpdate(ctx context.Context, obj, old runtime.Object) field.ErrorList {
	m, _ := meta.Accessor(obj)
	om, _ := meta.Accessor(old)
	errs := apivalidation.ValidateObjectMetaAccessorUpdate(m, om, field.NewPath("metadata"))
	if s.def.validate != nil {
		errs = append(errs, s.def.validate(obj, old)...)
	}
	if s.resize {
		errs = append(errs, validateResize(obj, old)...)
	}
	return errs
}

// GetResetFields tells server-side apply which fields this endpoint ignores.
func (s strategy) GetResetFields() map[fieldpath.APIVersion]*fieldpath.Set {
	if !s.def.hasStatus {
		return nil
	}
	reset := fieldpath.NewSet(fieldpath.MakePathOrDie("status"))
	if s.status {
		reset = fieldpath.NewSet(fieldpath.MakePathOrDie("spec"))
	}
	return map[fieldpath.APIVersion]*fieldpath.Set{fieldpath.APIVersion(s.def.gv.String()): reset}
}

// ---- storage ----

// resourceStore adds discovery details (short names, categories) to a Store.
type resourceStore struct {
	*genericregistry.Store
	def *resourceDef
}

func (r *resourceStore) ShortNames() []string { return r.def.shortNames }
func (r *resourceStore) Categories() []string { return r.def.categories }

// statusREST exposes only get/update/patch of the /status subresource.
type statusREST struct{ store *genericregistry.Store }

func (r *statusREST) New() runtime.Object { return r.store.New() }
func (r *statusREST) Destroy()            {}
func (r *statusREST) Get(ctx context.Context, name string, o *metav1.GetOptions) (runtime.Object, error) {
	return r.store.Get(ctx, name, o)
}
func (r *statusREST) Update(ctx context.Context, name string, objInfo rest.UpdatedObjectInfo, cv rest.ValidateObjectFunc,
	uv rest.ValidateObjectUpdateFunc, force bool, o *metav1.UpdateOptions) (runtime.Object, bool, error) {
	// Subresources never create the object (like upstream).
	return r.store.Update(ctx, name, objInfo, cv, uv, false, o)
}
func (r *statusREST) GetResetFields() map[fieldpath.APIVersion]*fieldpath.Set {
	return r.store.ResetFieldsStrategy.GetResetFields()
}
func (r *statusREST) ConvertToTable(ctx context.Context, obj runtime.Object, opts runtime.Object) (*metav1.Table, error) {
	return r.store.ConvertToTable(ctx, obj, opts)
}

func newStore(def *resourceDef, getter generic.RESTOptionsGetter) (*genericregistry.Store, error) {
	gvk := def.gv.WithKind(def.kind)
	gr := schema.GroupResource{Group: def.gv.Group, Resource: def.resource}
	st := strategy{ObjectTyper: coreScheme, NameGenerator: names.SimpleNameGenerator, def: def}
	fieldsFn := def.fieldsFn
	if fieldsFn == nil {
		fieldsFn = objectMetaFields
	}
	store := &genericregistry.Store{
		NewFunc: func() runtime.Object {
			o, _ := coreScheme.New(gvk)
			return o
		},
		NewListFunc: func() runtime.Object {
			o, _ := coreScheme.New(def.gv.WithKind(def.kind + "List"))
			return o
		},
		DefaultQualifiedResource:  gr,
		SingularQualifiedResource: schema.GroupResource{Group: def.gv.Group, Resource: def.singular},
		CreateStrategy:            st,
		UpdateStrategy:            st,
		DeleteStrategy:            st,
		ResetFieldsStrategy:       st,
		TableConvertor:            newTable(def),
	}
	if def.ttl > 0 {
		ttl := def.ttl
		store.TTLFunc = func(runtime.Object, uint64, bool) (uint64, error) { return ttl, nil }
	}
	attrs := func(obj runtime.Object) (labels.Set, fields.Set, error) {
		m, err := meta.Accessor(obj)
		if err != nil {
			return nil, nil, err
		}
		return labels.Set(m.GetLabels()), fieldsFn(obj), nil
	}
	opts := &generic.StoreOptions{RESTOptions: getter, AttrFunc: attrs}
	if def.resource == "pods" {
		// Let the watch cache index pods by node, as kube-apiserver does.
		opts.TriggerFunc = storage.IndexerFuncs{"spec.nodeName": func(obj runtime.Object) string {
			return obj.(*corev1.Pod).Spec.NodeName
		}}
	}
	if err := store.CompleteWithOptions(opts); err != nil {
		return nil, fmt.Errorf("%s: %w", def.resource, err)
	}
	return store, nil
}

// buildCoreGroups returns the legacy /api/v1 group and the other groups.
func buildCoreGroups(getter generic.RESTOptionsGetter) (*genericapiserver.APIGroupInfo, []*genericapiserver.APIGroupInfo, error) {
	byGroup := map[string]*genericapiserver.APIGroupInfo{}
	var order []string
	for i := range coreResources {
		def := &coreResources[i]
		info, ok := byGroup[def.gv.Group]
		if !ok {
			g := genericapiserver.NewDefaultAPIGroupInfo(def.gv.Group, coreScheme, metav1.ParameterCodec, coreCodecs)
			info = &g
			info.VersionedResourcesStorageMap[def.gv.Version] = map[string]rest.Storage{}
			byGroup[def.gv.Group] = info
			order = append(order, def.gv.Group)
		}
		m := info.VersionedResourcesStorageMap[def.gv.Version]
		store, err := newStore(def, getter)
		if err != nil {
			return nil, nil, err
		}
		m[def.resource] = &resourceStore{Store: store, def: def}
		if def.resource == "namespaces" {
			namespaceStore = store
		}
		if def.hasStatus {
			statusStore := *store
			st := strategy{ObjectTyper: coreScheme, NameGenerator: names.SimpleNameGenerator, def: def, status: true}
			statusStore.UpdateStrategy = st
			statusStore.ResetFieldsStrategy = st
			m[def.resource+"/status"] = &statusREST{store: &statusStore}
		}
		if def.resource == "pods" {
			// Deleting a pod returns the pod (clients expect a Pod, not a Status).
			store.ReturnDeletedObject = true
			m["pods/binding"] = &bindingREST{store: store}
			resizeStore := *store
			rs := strategy{ObjectTyper: coreScheme, NameGenerator: names.SimpleNameGenerator, def: def, resize: true}
			resizeStore.UpdateStrategy = rs
			resizeStore.ResetFieldsStrategy = rs
			m["pods/resize"] = &statusREST{store: &resizeStore}
			m["bindings"] = &legacyBindingREST{bindingREST{store: store}}
		}
	}
	var others []*genericapiserver.APIGroupInfo
	for _, g := range order {
		if g != "" {
			others = append(others, byGroup[g])
		}
	}
	return byGroup[""], others, nil
}

// namespaceStore is kept to create the standard namespaces at start.
var namespaceStore *genericregistry.Store

// createStandardNamespaces makes "default", "kube-system", ... exist, as
// kube-apiserver does: clients and tools assume them.
func createStandardNamespaces(ctx context.Context) error {
	for _, name := range []string{"default", "kube-system", "kube-public", "kube-node-lease"} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
		_, err := namespaceStore.Create(genericapirequest.WithNamespace(ctx, ""), ns, nil, &metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("creating namespace %s: %w", name, err)
		}
	}
	return nil
}

// ---- pods/binding: how a scheduler assigns a pod to a node ----

type bindingREST struct{ store *genericregistry.Store }

func (r *bindingREST) New() runtime.Object   { return &corev1.Binding{} }
func (r *bindingREST) Destroy()              {}
func (r *bindingREST) NamespaceScoped() bool { return true }

// legacyBindingREST serves POST /api/v1/namespaces/NS/bindings, the older
// form of pods/binding (the pod name is the Binding's name).
type legacyBindingREST struct{ bindingREST }

func (r *legacyBindingREST) GetSingularName() string { return "binding" }

func (r *legacyBindingREST) Create(ctx context.Context, obj runtime.Object, createValidation rest.ValidateObjectFunc,
	options *metav1.CreateOptions) (runtime.Object, error) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return nil, err
	}
	return r.bindingREST.Create(ctx, m.GetName(), obj, createValidation, options)
}

func (r *bindingREST) Create(ctx context.Context, name string, obj runtime.Object, createValidation rest.ValidateObjectFunc,
	options *metav1.CreateOptions) (runtime.Object, error) {
	b, ok := obj.(*corev1.Binding)
	if !ok {
		return nil, apierrors.NewBadRequest(fmt.Sprintf("not a Binding: %T", obj))
	}
	if b.Name != name {
		return nil, apierrors.NewBadRequest("name in URL does not match name in Binding")
	}
	if b.Target.Kind != "" && b.Target.Kind != "Node" {
		return nil, apierrors.NewBadRequest("binding target must be a Node")
	}
	if b.Target.Name == "" {
		return nil, apierrors.NewBadRequest("binding target name is required")
	}
	if createValidation != nil {
		if err := createValidation(ctx, obj); err != nil {
			return nil, err
		}
	}
	key, err := r.store.KeyFunc(ctx, name)
	if err != nil {
		return nil, err
	}
	var pre *storage.Preconditions
	if b.UID != "" {
		pre = &storage.Preconditions{UID: &b.UID}
	}
	dryRun := options != nil && len(options.DryRun) > 0
	err = r.store.Storage.GuaranteedUpdate(ctx, key, &corev1.Pod{}, false, pre,
		func(in runtime.Object, _ storage.ResponseMeta) (runtime.Object, *uint64, error) {
			pod := in.(*corev1.Pod)
			if pod.DeletionTimestamp != nil {
				return nil, nil, apierrors.NewConflict(corev1.Resource("pods/binding"), name, fmt.Errorf("pod %s is being deleted", name))
			}
			if pod.Spec.NodeName != "" {
				return nil, nil, apierrors.NewConflict(corev1.Resource("pods/binding"), name,
					fmt.Errorf("pod %s is already assigned to node %q", name, pod.Spec.NodeName))
			}
			pod.Spec.NodeName = b.Target.Name
			for k, v := range b.Annotations {
				if pod.Annotations == nil {
					pod.Annotations = map[string]string{}
				}
				pod.Annotations[k] = v
			}
			setPodScheduled(pod)
			return pod, nil, nil
		}, dryRun, nil)
	if err != nil {
		return nil, err
	}
	return &metav1.Status{Status: metav1.StatusSuccess, Code: 201}, nil
}

func setPodScheduled(pod *corev1.Pod) {
	now := metav1.Now()
	for i := range pod.Status.Conditions {
		if pod.Status.Conditions[i].Type == corev1.PodScheduled {
			pod.Status.Conditions[i].Status = corev1.ConditionTrue
			pod.Status.Conditions[i].LastTransitionTime = now
			return
		}
	}
	pod.Status.Conditions = append(pod.Status.Conditions, corev1.PodCondition{
		Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now})
}

// noServices: conversion webhooks by Service reference cannot be resolved here.
type noServices struct{}

func (noServices) ResolveEndpoint(namespace, name string, port int32) (*url.URL, error) {
	return nil, fmt.Errorf("service %s/%s: services are not served by pyk8sres-apiserver", namespace, name)
}
